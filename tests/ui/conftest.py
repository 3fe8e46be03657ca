"""`mlscale ui` in its own process, and a real browser (Debian's Chromium, driven by Playwright) for the
pages. Without Chromium or Playwright the browser tests skip (fail in CI: `.ci/run` installs both)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.conftest import require_module, unavailable
from tests.helpers import REPO, free_port

CHROMIUM = os.environ.get("MLSCALE_CHROMIUM", "/usr/bin/chromium")
FIREFOX = os.environ.get("MLSCALE_FIREFOX", "/usr/bin/firefox-esr")  # the Firefox check (test_browser.py)
# Where the browser tests leave their screenshots: the README's come from `MLSCALE_UI_SCREENSHOTS=docs/ui`.
SCREENSHOTS_ENV = "MLSCALE_UI_SCREENSHOTS"


@contextmanager
def running_ui(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    """``mlscale ui ARGS`` on a free loopback port; yields (base URL, process); stopped after."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "mlscale", "ui", "--port", str(port), *args], cwd=Path.cwd(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if process.poll() is not None:
                raise AssertionError(f"mlscale ui exited with {process.returncode}: {process.stderr.read()}")
            try:
                httpx.get(f"{base}/api/info", timeout=2)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise AssertionError("mlscale ui did not answer within its timeout") from None
                time.sleep(0.1)
        yield base, process
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (Debian's package), one per test module."""
    sync_api = require_module("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        unavailable(f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)")
    with sync_api.sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield instance
        finally:
            instance.close()


@pytest.fixture
def screenshots(tmp_path) -> Path:
    folder = Path(os.environ.get(SCREENSHOTS_ENV) or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class Watched:
    """A page with every console error and uncaught exception it produced."""

    def __init__(self, browser, width: int = 1400, height: int = 1000) -> None:
        self.page = browser.new_page(viewport={"width": width, "height": height})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(f"console {m.type}: {m.text}")
                     if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))

    def open(self, url: str, timeout_ms: int = 30_000) -> None:
        """Go to ``url`` and wait until the view says it has drawn (``body[data-ready]`` for that view)."""
        self.page.goto(url)
        self.ready(url.split("#", 1)[1] if "#" in url else "/runs", timeout_ms)

    def ready(self, hash_path: str, timeout_ms: int = 30_000) -> None:
        self.page.wait_for_selector("body[data-ready]", state="attached", timeout=timeout_ms)
        deadline = time.monotonic() + timeout_ms / 1e3
        while self.page.evaluate("() => decodeURIComponent(document.body.dataset.ready || '')") != hash_path:
            assert time.monotonic() < deadline, f"the view {hash_path} never said it was drawn"
            time.sleep(0.05)

    def series(self, chart_id: str) -> list[dict]:
        """What a chart holds now: its series' names and data, read from ECharts itself."""
        return self.page.evaluate("""(id) => {
            const chart = echarts.getInstanceByDom(document.getElementById(id));
            return chart.getOption().series.map((s) => ({name: s.name, type: s.type, data: s.data,
                markLine: (s.markLine && s.markLine.data) || [], markArea: (s.markArea && s.markArea.data) || []}));
        }""", chart_id)

    def option(self, chart_id: str, path: str):
        return self.page.evaluate("""([id, path]) => {
            const chart = echarts.getInstanceByDom(document.getElementById(id));
            return path.split('.').reduce((o, k) => o[k], chart.getOption());
        }""", [chart_id, path])

    def close(self) -> None:
        self.page.close()
