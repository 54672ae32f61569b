"""The live page of ``minipaged serve`` in a real browser (headless Debian Chromium).

The server runs in this process on 127.0.0.1; Playwright drives the system Chromium (as
``tests/viz/test_browser.py`` does) to ``/``; requests are sent while the page is open, and the
picture must change: blocks take their owners' colours (``minipaged.viz.palette``), rows
for the running sequences appear, and all blocks are free again when the requests end.
Under load in a pool of thousands of blocks, every block id fits its block-table cell and
every label reads on its fill (WCAG contrast >= 4.5, the text colour from
``palette.text_color_on``).

Skipped with the reason where Playwright or Chromium is missing
(``apt-get install chromium``; ``pip install playwright``, no ``playwright install``).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="fastapi is not installed")

CHROMIUM = os.environ.get("MINIPAGED_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _sync_api():
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="playwright is not installed (pip install playwright; no `playwright install`)",
    )
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"Chromium not found at {CHROMIUM} (apt-get install chromium)")
    return sync_api


def test_live_page_follows_the_server(tmp_path):
    sync_api = _sync_api()
    from minipaged.engine.llm_engine import LLMEngine
    from minipaged.entrypoints.openai.api_server import BackgroundServer
    from minipaged.viz.palette import FREE_GREY, owner_color

    engine = LLMEngine(num_blocks=128, max_num_seqs=8)
    with BackgroundServer(engine, check_invariants=True) as srv, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(srv.url + "/")
            page.wait_for_function(
                "() => document.getElementById('status').textContent.startsWith('connected')", timeout=30_000
            )
            assert page.locator("#pool rect").count() == engine.num_blocks
            before = page.locator("#pool").screenshot()
            assert page.evaluate("document.body.dataset.used") is None  # no step drawn yet

            replies = []

            def send(k: int) -> None:
                r = httpx.post(
                    srv.url + "/v1/completions",
                    timeout=120,
                    json={"prompt": f"Once upon a time, {k}", "max_tokens": 300, "temperature": 0.0},
                )
                replies.append(r.status_code)

            senders = [threading.Thread(target=send, args=(k,)) for k in range(4)]
            for t in senders:
                t.start()
            # the picture changes: blocks in use, one row per running sequence
            page.wait_for_function(
                "() => Number(document.body.dataset.used || 0) >= 4"
                " && document.querySelectorAll('#seqs g[data-seq]').length >= 2",
                timeout=60_000,
            )
            during = page.locator("#pool").screenshot()
            deadline = time.monotonic() + 20
            while during == before and time.monotonic() < deadline:
                time.sleep(0.2)
                during = page.locator("#pool").screenshot()
            assert during != before, "the block picture did not change"
            fills = page.evaluate(
                "Array.from(document.querySelectorAll('#pool rect[data-owner]'))"
                ".map(r => r.getAttribute('fill'))"
            )
            palette = {owner_color(k) for k in range(21)}
            assert fills and set(fills) <= palette, set(fills) - palette
            states = page.evaluate(
                "Array.from(document.querySelectorAll('#seqs g[data-seq]'))"
                ".map(g => g.getAttribute('data-state'))"
            )
            assert set(states) <= {"prefill", "decode", "running", "waiting"}
            (tmp_path / "during.png").write_bytes(during)
            (tmp_path / "page.png").write_bytes(page.screenshot())
            for t in senders:
                t.join(120)
            assert replies == [200] * 4
            # the requests ended: every block is free (grey) again
            page.wait_for_function(
                "() => document.body.dataset.used === '0'"
                " && document.querySelectorAll('#seqs g[data-seq]').length === 0",
                timeout=60_000,
            )
            free = page.evaluate(
                "Array.from(document.querySelectorAll('#pool rect'))"
                ".every(r => r.getAttribute('fill') === '" + FREE_GREY + "')"
            )
            assert free
        finally:
            browser.close()
    assert srv.serving.engine_client.errors == []


# every label drawn on a fill in the sequences panel, with its fill's box: block ids
# (data-block) and state names (data-on) follow the rect they are drawn on
_LABELS = """() => Array.from(document.querySelectorAll('#seqs text[data-block], #seqs text[data-on]'))
  .map(t => { const r = t.previousElementSibling, b = t.getBBox();
    return {text: t.textContent, fill: t.getAttribute('fill'), on: r.getAttribute('fill'),
            x: b.x, w: b.width, rx: Number(r.getAttribute('x')), rw: Number(r.getAttribute('width'))}; })"""


def test_live_page_fits_4_digit_ids_and_labels_read(tmp_path):
    """Thousands of blocks (block size 1), 20 sequences: ids >= 1000 in the block tables
    are drawn whole inside their cells, and every label (block ids on request colours,
    state names on state colours) has WCAG contrast >= 4.5 with its cell, for each of the
    21 request colours the page is sent."""
    sync_api = _sync_api()
    from minipaged.engine.llm_engine import LLMEngine
    from minipaged.entrypoints.openai.api_server import BackgroundServer
    from minipaged.viz.palette import REQUEST_COLORS, contrast_ratio

    engine = LLMEngine(num_blocks=6000, block_size=1, max_num_seqs=20)
    with BackgroundServer(engine, check_invariants=True) as srv, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(srv.url + "/")
            page.wait_for_function(
                "() => document.getElementById('status').textContent.startsWith('connected')", timeout=30_000
            )
            cfg = page.evaluate("cfg.colors")
            assert cfg["owners"] == REQUEST_COLORS
            for fill, text in zip(cfg["owners"], cfg["text"]["owners"]):
                assert contrast_ratio(text, fill) >= 4.5, (fill, text)

            replies = []

            def send(body: dict) -> None:
                r = httpx.post(srv.url + "/v1/completions", timeout=120, json={"temperature": 0.0, **body})
                replies.append(r.status_code)

            # four long prompts hold blocks 0..1199 and up, so the next requests get ids >= 1000
            holders = threading.Thread(
                target=send, args=({"prompt": [list(range(5, 305))] * 4, "max_tokens": 200},)
            )
            holders.start()
            page.wait_for_function("() => Number(document.body.dataset.used || 0) >= 1200", timeout=60_000)
            senders = [
                threading.Thread(target=send, args=({"prompt": f"Once upon a time, {k}", "max_tokens": 200},))
                for k in range(16)
            ]
            for t in senders:
                t.start()
            page.wait_for_function(
                "() => Array.from(document.querySelectorAll('#seqs text[data-block]'))"
                ".some(t => Number(t.textContent) >= 1000)"
                " && document.querySelectorAll('#seqs g[data-seq]').length >= 12",
                timeout=60_000,
            )
            labels = page.evaluate(_LABELS)
            (tmp_path / "page.png").write_bytes(page.screenshot(full_page=True))
            for t in senders + [holders]:
                t.join(120)
            assert replies == [200] * 17
        finally:
            browser.close()
    assert srv.serving.engine_client.errors == []
    ids = [lab for lab in labels if lab["text"].isdigit()]
    assert max(int(lab["text"]) for lab in ids) >= 1000
    assert len({lab["on"] for lab in ids}) >= 12  # most request colours drawn, the dark ones too
    for lab in labels:
        # drawn whole inside its cell (a clipped or overflowing id would spill past the rect)
        assert lab["rx"] <= lab["x"] and lab["x"] + lab["w"] <= lab["rx"] + lab["rw"], lab
        assert contrast_ratio(lab["fill"], lab["on"]) >= 4.5, lab
