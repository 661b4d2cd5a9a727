"""The terminal in Chromium on a real shell: our envd (in a throwaway root on loopback, as
tests/envd run it) behind the dashboard's WebSocket, for a sandbox of a node on doubles."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from playwright.async_api import Browser, Page, expect
from starlette.applications import Starlette

from tests.dashboard.browser import chromium, new_page, screenshot
from tests.dashboard.conftest import KEY, Site
from tests.dashboard.real_envd import dashboard_on
from tests.support.envd_process import envd_in_throwaway_root
from tests.support.loopback_api import served
from tests.support.ports import free_port
from tests.support.wait import SAFETY_S

# Polls of the terminal's text, 0.1 s apart: the tests' one bound on a wait (a hang).
POLLS = int(SAFETY_S * 10)


@pytest.fixture(scope="module")
def envd_port() -> Iterator[int]:
    port = free_port()
    with envd_in_throwaway_root(port):
        yield port


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with chromium() as browser:
        yield browser


@pytest.fixture
async def url(site: Site, envd_port: int) -> AsyncIterator[str]:
    async with dashboard_on(site, envd_port) as dashboard, served(dashboard) as base:
        yield base


async def lines(page: Page) -> list[str]:
    text = await page.locator(".xterm-rows").inner_text()
    return [line.strip() for line in text.replace("\xa0", " ").split("\n")]


async def prompt(page: Page) -> None:
    """Wait until the shell shows its prompt again: what is typed next is its next command."""
    for _ in range(POLLS):
        shown = [line for line in await lines(page) if line]
        if shown and shown[-1].endswith("$"):
            return
        await page.wait_for_timeout(100)
    raise AssertionError(f"no prompt in {await lines(page)}")


async def run(page: Page, command: str, expected: str | None = None) -> str | None:
    """Type `command` and Enter; wait for the last line that fully matches the pattern
    `expected` (returned), and the prompt."""
    await page.keyboard.type(command)
    await page.keyboard.press("Enter")
    found = None
    if expected is not None:
        for _ in range(POLLS):
            found = next(
                (s for s in reversed(await lines(page)) if re.fullmatch(expected, s)), None
            )
            if found is not None:
                break
            await page.wait_for_timeout(100)
        else:
            raise AssertionError(f"no line {expected!r} in {await lines(page)}")
    await prompt(page)
    return found


async def test_a_shell_in_the_page(site: Site, url: str, browser: Browser, tmp_path: Path) -> None:
    sandbox_id = await site.create()
    async with new_page(browser, viewport={"width": 1200, "height": 900}) as page:
        await page.goto(f"{url}/dashboard/sign-in")
        await page.fill("#key", KEY)
        await page.click(".sign-in button")
        await page.click(f"a[href='/dashboard/sandboxes/{sandbox_id}']")
        await expect(page.locator("#terminal-status")).to_have_text("connected")
        await page.click("#terminal")
        await prompt(page)
        await run(page, "echo hi", "hi")
        # Ctrl-C ends what runs; the shell stays. The command says when it runs in the
        # foreground (a Ctrl-C before that would reach bash, and the sleep would stay).
        await page.keyboard.type("sh -c 'echo sleep-started; exec sleep 600'")
        await page.keyboard.press("Enter")
        for _ in range(POLLS):
            if "sleep-started" in await lines(page):
                break
            await page.wait_for_timeout(100)
        await page.keyboard.press("Control+C")
        await prompt(page)
        await run(page, "echo after", "after")
        # A paste arrives as typed text.
        await page.keyboard.insert_text("echo pasted")
        await page.keyboard.press("Enter")
        await expect(page.locator(".xterm-rows")).to_contain_text("pasted")
        await prompt(page)
        # The PTY follows the terminal's size.
        before = await run(page, "clear; stty size | tr ' ' x", r"\d+x\d+")
        await page.set_viewport_size({"width": 700, "height": 700})
        for _ in range(20):  # the page sees its new size, then the PTY is told
            after = await run(page, "clear; stty size | tr ' ' x", r"\d+x\d+")
            if after != before:
                break
        assert before != after, (before, after)
        # Reconnecting comes back to the same shell.
        await run(page, "KEPT=kept-value")
        await page.click("#terminal-reconnect")
        await expect(page.locator("#terminal-status")).to_have_text("connected")
        await page.click("#terminal")
        await page.keyboard.press("Enter")
        await prompt(page)
        await run(page, "echo $KEPT", "kept-value")
        await screenshot(page, "terminal", tmp_path)
        await page.keyboard.type("exit")
        await page.keyboard.press("Enter")
        await expect(page.locator("#terminal-status")).to_have_text("the shell exited (0)")


async def test_another_origin_cannot_open_a_terminal(
    site: Site, url: str, browser: Browser
) -> None:
    sandbox_id = await site.create()
    socket = url.replace("http:", "ws:") + f"/dashboard/sandboxes/{sandbox_id}/terminal"
    opens = """(url) => new Promise((done) => {
        const s = new WebSocket(url);
        s.onmessage = () => { s.close(1000); done("opened"); };
        s.onclose = (e) => done("closed " + e.code);
    })"""
    async with new_page(browser) as page:
        await page.goto(f"{url}/dashboard/sign-in")
        await page.fill("#key", KEY)
        await page.click(".sign-in button")
        assert await page.evaluate(opens, socket) == "opened"
        # Another site's page (another port: the same site to the session cookie, which the
        # browser sends along) is refused before the handshake ends.
        async with served(Starlette()) as other:
            await page.goto(other)
            assert await page.evaluate(opens, socket) == "closed 1006"


async def test_files_in_the_page(site: Site, url: str, browser: Browser, tmp_path: Path) -> None:
    """The files page in Chromium: a file uploaded with the page's form is listed, in the
    directory shown."""
    sandbox_id = await site.create()
    upload = tmp_path / "notes.txt"
    upload.write_text("uploaded from the page\n")
    async with new_page(browser) as page:
        await page.goto(f"{url}/dashboard/sign-in")
        await page.fill("#key", KEY)
        await page.click(".sign-in button")
        await page.goto(f"{url}/dashboard/sandboxes/{sandbox_id}/files?path=/home/user")
        await page.set_input_files("input[type=file]", str(upload))
        await page.click("form.inline button")
        await expect(page.locator("tr[data-file='notes.txt']")).to_be_visible()
        await screenshot(page, "files", tmp_path)
