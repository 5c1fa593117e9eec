"""Headless Chromium for the tests that look at web pages (Flower, TensorBoard).

Playwright drives Debian's system Chromium (``/usr/bin/chromium``); it downloads no browser.
Screenshots land in ``test-artifacts/`` for a person to look at.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import system_tools
from .conftest import ROOT

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
#: Where the browser tests keep their screenshots.
ARTIFACTS = ROOT / "test-artifacts"


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless system Chromium (skips naming the package when it is missing, fails on CI)."""
    from playwright.sync_api import sync_playwright

    executable = system_tools.tool(str(CHROMIUM), "chromium")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def screenshot(page: Any, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path
