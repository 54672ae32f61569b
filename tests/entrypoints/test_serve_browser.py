"""The live page of ``minipaged serve`` in a real browser (headless Debian Chromium).

The server runs in this process on 127.0.0.1; Playwright drives the system Chromium (as
``tests/viz/test_browser.py`` does) to ``/``; requests are sent while the page is open, and the
picture must change: blocks take their owners' colours (``minipaged.viz.palette``), rows
for the running sequences appear, and all blocks are free again when the requests end.

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


def test_live_page_follows_the_server(tmp_path):
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="playwright is not installed (pip install playwright; no `playwright install`)",
    )
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"Chromium not found at {CHROMIUM} (apt-get install chromium)")
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
