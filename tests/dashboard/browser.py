"""Headless Chromium for the dashboard's tests: Debian's `chromium` (install-system-deps.sh
test) driven by Playwright, one browser per test module, a fresh profile per context."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from playwright.async_api import Browser, ConsoleMessage, Dialog, Page, async_playwright, expect

from tests.support.wait import SAFETY_S

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
# How long a step or an expectation may wait: the tests' one bound on a wait, reached only by
# a hang (Playwright's default of 5 s failed correct tests beside VMs under TCG).
TIMEOUT_MS = int(SAFETY_S * 1000)
expect.set_options(timeout=TIMEOUT_MS)


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


@asynccontextmanager
async def new_page(browser: Browser, **options: Any) -> AsyncIterator[Page]:
    """A page in a context of its own, which accepts the actions' confirmations, and fails the
    test on any console error but a refused request's (which tests cause): a
    Content-Security-Policy violation is one."""
    context = await browser.new_context(**options)
    context.set_default_timeout(TIMEOUT_MS)
    page = await context.new_page()

    async def accept(dialog: Dialog) -> None:
        await dialog.accept()

    errors: list[str] = []

    def console(message: ConsoleMessage) -> None:
        refused = ("Failed to load resource", "WebSocket connection to")
        if message.type == "error" and not message.text.startswith(refused):
            errors.append(message.text)

    page.on("dialog", accept)
    page.on("console", console)
    try:
        yield page
    finally:
        await context.close()
    assert errors == []
