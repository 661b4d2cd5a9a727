"""Headless Chromium for the dashboard's tests: Debian's `chromium` (install-system-deps.sh
test) driven by Playwright, one browser per test module, a fresh profile per context."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from playwright.async_api import Browser, Page, async_playwright

CHROMIUM = "/usr/bin/chromium"
# No sandbox (tests run as root), no GPU, and nothing a browser fetches on its own: the tests'
# traffic stays on loopback.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# Where the pages' screenshots go: docs/dashboard/ when regenerating docs/dashboard.md's
# pictures (`AENV_DASHBOARD_SHOTS=docs/dashboard`), else the test's own directory.
SHOTS = "AENV_DASHBOARD_SHOTS"


@asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    """Playwright gives every launch a new temporary profile, removed when it closes."""
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=FLAGS
        )
        try:
            yield browser
        finally:
            await browser.close()


async def screenshot(page: Page, name: str, fallback: Path) -> Path:
    directory = Path(os.environ.get(SHOTS) or fallback)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.png"
    await page.screenshot(path=str(path), full_page=True)
    return path
