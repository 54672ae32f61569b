"""A real-browser test of the stepper widget in JupyterLab (chapter 00).

JupyterLab runs headless on 127.0.0.1 (a random free port, a random token) over a copy of
notebooks/00_overview.ipynb; Debian's Chromium, driven by Playwright, opens it, runs all
cells, finds the stepper, drags its slider, and checks that the picture changed
(screenshots differ) and that the label reads the step the slider now shows.

Skipped with the reason where Playwright or Chromium is missing. Install:
``apt-get install chromium`` and ``pip install playwright`` (not ``playwright install``:
Playwright's own browser download does not work here; the system Chromium is used).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("MINIPAGED_CHROMIUM", "/usr/bin/chromium")
NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "00_overview.ipynb"
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
LABEL = re.compile(r"^step (\d+) / (\d+)$")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_server(url: str, proc: subprocess.Popen, timeout: float = 40.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                json.load(r)
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("jupyter lab did not start in time")


@pytest.fixture
def lab(tmp_path):
    if not NOTEBOOK.exists():
        pytest.skip(f"{NOTEBOOK} is missing")
    if shutil.which("jupyter-lab", path=os.path.dirname(sys.executable)) is None:
        try:
            import jupyterlab  # noqa: F401
        except ImportError:
            pytest.skip("jupyterlab is not installed")
    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ)
    # NOTE: settings and workspaces in the temporary folder, so no user state leaks in
    env["JUPYTER_CONFIG_DIR"] = str(tmp_path / "config")
    env["JUPYTERLAB_SETTINGS_DIR"] = str(tmp_path / "settings")
    env["JUPYTERLAB_WORKSPACES_DIR"] = str(tmp_path / "workspaces")
    env["JUPYTER_RUNTIME_DIR"] = str(tmp_path / "runtime")
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    # no "would you like news?" toast over the notebook
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    # every cell rendered (no windowing), so off-screen outputs have their text too
    nb_settings = tmp_path / "settings" / "@jupyterlab" / "notebook-extension"
    nb_settings.mkdir(parents=True)
    (nb_settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.port_retries=0",
        "--expose-app-in-browser",
        "--allow-root",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_server(f"http://127.0.0.1:{port}/api/status?token={token}", proc)
        yield f"http://127.0.0.1:{port}", token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_stepper_moves_in_jupyterlab(lab, tmp_path):
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="playwright is not installed (pip install playwright; no `playwright install`)",
    )
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"Chromium not found at {CHROMIUM} (apt-get install chromium)")
    base, token = lab
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?reset&token={token}")
            page.wait_for_function(
                "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                " && window.jupyterapp.shell.currentWidget.sessionContext"
                " && window.jupyterapp.shell.currentWidget.sessionContext.session"
                " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel",
                timeout=45_000,
            )
            page.evaluate("window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")

            stepper = page.locator(".minipaged-stepper").first
            stepper.wait_for(state="visible", timeout=60_000)
            stepper.scroll_into_view_if_needed()
            label = stepper.locator(".minipaged-step-label")
            image = stepper.locator("img").first
            image.wait_for(state="visible", timeout=30_000)
            deadline = time.monotonic() + 30
            while not LABEL.match(label.text_content().strip()) and time.monotonic() < deadline:
                time.sleep(0.2)
            m = LABEL.match(label.text_content().strip())
            assert m, f"unexpected label {label.text_content()!r}"
            start, last = int(m.group(1)), int(m.group(2))
            stepper.scroll_into_view_if_needed()
            before = image.screenshot()

            # drag the slider's handle most of the way right
            handle = stepper.locator(".noUi-handle").first
            track = stepper.locator(".noUi-target, .widget-slider").first
            hb, tb = handle.bounding_box(), track.bounding_box()
            page.mouse.move(hb["x"] + hb["width"] / 2, hb["y"] + hb["height"] / 2)
            page.mouse.down()
            page.mouse.move(tb["x"] + tb["width"] * 0.8, hb["y"] + hb["height"] / 2, steps=8)
            page.mouse.up()

            def current() -> tuple[int, str]:
                now = handle.get_attribute("aria-valuenow")
                return int(float(now)), label.text_content().strip()

            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                value, text = current()
                if value != start and text == f"step {value} / {last}":
                    break
                time.sleep(0.2)
            value, text = current()
            assert value != start, "the slider did not move"
            assert text == f"step {value} / {last}", f"label {text!r} for slider at {value}"

            after = image.screenshot()
            deadline = time.monotonic() + 20
            while after == before and time.monotonic() < deadline:
                time.sleep(0.3)
                after = image.screenshot()
            (tmp_path / "before.png").write_bytes(before)
            (tmp_path / "after.png").write_bytes(after)
            assert after != before, "the picture did not change when the slider moved"
        finally:
            browser.close()
