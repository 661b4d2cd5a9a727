"""The template pages over HTTP: a failed build listed with its reason, and a build's log
followed live (server-sent events) until it is ready."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.dashboard.conftest import KEY, Site, page_client
from tests.support.wait import eventually


@pytest.fixture
async def browser(site: Site) -> AsyncIterator[httpx.AsyncClient]:
    async with page_client(site.dashboard) as client:
        signed_in = await client.post("/dashboard/sign-in", data={"key": KEY})
        assert signed_in.status_code == 303
        yield client


async def test_a_failed_build_shows_its_reason(site: Site, browser: httpx.AsyncClient) -> None:
    ids = await site.build("broken", [{"type": "RUN", "args": ["exit 3"]}])

    async def failed() -> bool:
        return await site.build_status(ids) == "error"

    await eventually(failed, "the build failed", interval=0.02)
    listed = await browser.get("/dashboard/templates")
    assert "broken" in listed.text
    assert f'href="/dashboard/templates/{ids[0]}/builds/{ids[1]}"' in listed.text
    page = await browser.get(f"/dashboard/templates/{ids[0]}/builds/{ids[1]}")
    assert page.status_code == 200
    assert "status-error" in page.text
    assert "exit 3" in page.text  # the reason names the step's command
    assert "data-follow" not in page.text  # nothing more to follow
    gone = await browser.get(f"/dashboard/templates/{ids[0]}/builds/nope")
    assert gone.status_code == 404


async def test_a_builds_log_is_followed_until_it_is_ready(
    site: Site, browser: httpx.AsyncClient
) -> None:
    held = site.driver.hold("snapshot")  # the build's steps have run; its save waits
    ids = await site.build("app", [{"type": "RUN", "args": ["echo first-step"]}])
    await held.reached.wait()
    page = await browser.get(f"/dashboard/templates/{ids[0]}/builds/{ids[1]}")
    assert "status-building" in page.text
    assert "first-step" in page.text
    live = page.text.split('data-follow="', 1)[1].split('"', 1)[0].replace("&amp;", "&")
    # Nothing new while the save waits: the stream sends the status only.
    waiting = await browser.get(live)
    assert "event: status\ndata: building" in waiting.text
    assert "event: lines" not in waiting.text
    held.release()

    async def ready() -> bool:
        return await site.build_status(ids) == "ready"

    await eventually(ready, "the build is ready", interval=0.02)
    ended = await browser.get(live)
    assert "event: lines" in ended.text  # what the build wrote after the page was made
    assert "first-step" not in ended.text  # and only that
    assert "event: status\ndata: ready" in ended.text
    assert ended.text.rstrip().endswith("event: complete\ndata:")
    # A browser that reconnects says where it got to: nothing is sent twice.
    last_id = [line for line in ended.text.splitlines() if line.startswith("id: ")][-1][4:]
    again = await browser.get(live, headers={"Last-Event-ID": last_id})
    assert "event: lines" not in again.text
