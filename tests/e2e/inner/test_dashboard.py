"""The dashboard on a real node, in headless Chromium started in the server's namespace: a
sandbox the SDK creates appears in the live list, its page charts its metrics, its terminal
runs `echo hi` in the guest through the node's envd client, and killing it from the page ends
it for the SDK too."""

from __future__ import annotations

import os
import re

from e2b import AsyncSandbox
from playwright.async_api import expect

from tests.dashboard.browser import chromium, new_page
from tests.e2e.inner.conftest import BASE, LIFETIME


async def test_a_sandbox_from_the_sdk_in_the_dashboard() -> None:
    async with chromium() as browser, new_page(browser) as page:
        await page.goto(f"{BASE}/dashboard/sign-in")
        await page.fill("#key", os.environ["E2B_API_KEY"])
        await page.click(".sign-in button")
        await expect(page).to_have_url(f"{BASE}/dashboard/sandboxes")
        sandbox = await AsyncSandbox.create(timeout=LIFETIME, metadata={"from": "sdk"})
        try:
            row = page.locator(f'tr[data-sandbox="{sandbox.sandbox_id}"]')
            await expect(row).to_be_visible(timeout=30_000)
            await row.locator("a").click()
            status = page.locator("#terminal-status")
            await expect(status).to_have_text("connected", timeout=60_000)
            # Its CPU and memory charts, drawn from the guest's real samples.
            charts = page.locator("figure.chart")
            await expect(charts.locator("canvas")).to_have_count(2)
            for n in range(2):
                await expect(charts.nth(n)).to_have_attribute("data-drawn", re.compile(r"^[1-9]"))
            await page.click("#terminal")
            await page.keyboard.type("echo hi")
            await page.keyboard.press("Enter")
            # A row that is `hi` alone: the prompt holds the sandbox's id, which may hold "hi".
            output = page.locator(".xterm-rows > div").filter(has_text=re.compile(r"^\s*hi\s*$"))
            await expect(output).to_have_count(1, timeout=30_000)
            await page.goto(f"{BASE}/dashboard/sandboxes")
            await row.locator("button", has_text="Kill").click()
            await expect(row).to_have_count(0, timeout=60_000)
            assert not await sandbox.is_running()
        finally:
            await AsyncSandbox.kill(sandbox.sandbox_id)
