"""A real headless Chromium (Debian's ``chromium``) driven by Playwright for Python, and screenshots.

Playwright never downloads a browser here: ``executable_path`` is the
system's ``/usr/bin/chromium`` (scripts/setup.sh installs it with apt-get).
Screenshots go to ``artifacts/screenshots/`` (not committed); with
``TOOLPROXY_DOC_SCREENSHOTS=1`` the ones the docs use are also written to
``docs/images/`` (that is how the committed images are made).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = REPO / "artifacts" / "screenshots"
DOC_IMAGES = REPO / "docs" / "images"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run", "--disable-sync"]

try:
    import playwright.async_api as _playwright
except ImportError:  # pragma: no cover - setup.sh installs it
    _playwright = None  # type: ignore[assignment]

needs_chromium = pytest.mark.skipif(_playwright is None or not os.access(CHROMIUM, os.X_OK),
                                    reason="needs Debian's chromium and the playwright package (scripts/setup.sh)")


@contextlib.asynccontextmanager
async def chromium_page(viewport: tuple[int, int] = (1400, 900)) -> AsyncIterator[Any]:
    """A fresh browser (no shared storage between tests) and one page in it."""
    assert _playwright is not None
    async with _playwright.async_playwright() as driver:
        browser = await driver.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            context = await browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
            yield await context.new_page()
        finally:
            await browser.close()


async def screenshot(page: Any, name: str, *, doc: bool = False, full_page: bool = True,
                     locator: Any = None) -> Path:
    """Save ``name``.png under artifacts/screenshots (and docs/images when asked and enabled)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    if locator is not None:
        await locator.screenshot(path=str(path))
    else:
        await page.screenshot(path=str(path), full_page=full_page)
    assert path.stat().st_size > 0
    if doc and os.environ.get("TOOLPROXY_DOC_SCREENSHOTS") == "1":
        DOC_IMAGES.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, DOC_IMAGES / path.name)
    return path
