"""``minipaged book``: the site built from the checkout, opened in headless Debian Chromium.

Every page of the site is loaded from ``file://`` with requests off the machine refused (a page
must render offline); each chapter and exercise page must be there, every local link must
point at a file of the site, every image must load (``naturalWidth > 0``), no solution may reach
an exercise page, and one chapter's reveal.js slides must start and step to the next slide.
Skipped with the reason where Playwright or Chromium is missing.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from minipaged.book import build_site, chapter_notebooks, course_root

CHROMIUM = os.environ.get("MINIPAGED_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip

LINKS_AND_IMAGES = """() => ({
  links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  images: [...document.images].map(i => [i.currentSrc || i.src, i.complete && i.naturalWidth > 0]),
})"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    built = build_site(out, slides=["03"])
    return out, built


def test_site_has_every_chapter_and_no_solution(site):
    out, built = site
    root = course_root()
    for nb in chapter_notebooks(root):
        assert f"notebooks/{nb.stem}.html" in built["pages"], nb.name
    exercises = [p for p in built["pages"] if p.startswith("notebooks/exercises/")]
    assert len(exercises) == len(list((root / "notebooks" / "exercises").glob("ch*.ipynb")))
    for page in exercises:
        text = (out / page).read_text()
        assert "BEGIN SOLUTION" not in text, page
    assert built["slides"] == ["slides/03_paged_attention.slides.html"]


def test_bad_chapter_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no chapter '42'"):
        build_site(tmp_path, slides=["42"])


def _open(p):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"Chromium not found at {CHROMIUM} (apt-get install chromium)")
    browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
    context = browser.new_context()
    # offline: anything not on the local disk is refused (MathJax's CDN script among them)
    context.route(
        "**/*", lambda route: route.continue_() if route.request.url.startswith("file:") else route.abort()
    )
    return browser, context


def test_every_page_renders_in_chromium(site):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    out, built = site
    with sync_api.sync_playwright() as p:
        browser, context = _open(p)
        try:
            page = context.new_page()
            seen_images = 0
            for rel in built["pages"]:
                page.goto((out / rel).as_uri(), wait_until="load")
                found = page.evaluate(LINKS_AND_IMAGES)
                for href in found["links"]:
                    url = urlparse(href)
                    if url.scheme == "file":
                        assert Path(unquote(url.path)).exists(), f"{rel}: broken link {href}"
                for src, ok in found["images"]:
                    assert ok, f"{rel}: image not loaded: {src[:80]}"
                seen_images += len(found["images"])
                if rel.startswith("notebooks/0"):
                    assert page.locator(".jp-Cell").count() > 0, f"{rel}: no cells rendered"
            assert seen_images > 0
        finally:
            browser.close()


def test_one_chapters_slides_open(site):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    out, built = site
    if built["notes"]:
        pytest.skip("; ".join(built["notes"]))
    with sync_api.sync_playwright() as p:
        browser, context = _open(p)
        try:
            page = context.new_page()
            page.goto((out / built["slides"][0]).as_uri(), wait_until="load")
            # reveal.js marks its root "ready" once it has laid the slides out
            page.wait_for_function("() => document.querySelector('.reveal.ready') !== null", timeout=30_000)
            assert page.locator(".reveal .slides > section").count() > 3
            page.keyboard.press("ArrowRight")
            page.wait_for_function("() => location.hash.startsWith('#/1')", timeout=10_000)
        finally:
            browser.close()
