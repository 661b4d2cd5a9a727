"""Sign-in, sessions, CSRF and the sandbox list's actions, on the dashboard's HTTP side (no
browser: tests/dashboard/test_browser.py drives the same pages in Chromium)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx
import pytest

from aenv.dashboard.app import CSP
from aenv.dashboard.sessions import COOKIE
from tests.dashboard.conftest import KEY, SECOND_KEY, Site, page_client


@pytest.fixture
async def browser(site: Site) -> AsyncIterator[httpx.AsyncClient]:
    """A client as a browser on the dashboard's own pages: no API key, its own cookies."""
    async with page_client(site.dashboard) as client:
        yield client


async def sign_in(browser: httpx.AsyncClient, key: str = KEY) -> str:
    """Signs in with `key`; the session's CSRF token, as its pages carry it."""
    signed_in = await browser.post("/dashboard/sign-in", data={"key": key})
    assert signed_in.status_code == 303, signed_in.text
    assert signed_in.headers["location"] == "/dashboard/sandboxes"
    page = await browser.get("/dashboard/sandboxes")
    assert page.status_code == 200
    found = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert found is not None
    return found.group(1)


def signed_out(response: httpx.Response) -> bool:
    return response.status_code == 303 and response.headers["location"] == "/dashboard/sign-in"


async def test_a_key_signs_in_into_an_httponly_strict_cookie(browser: httpx.AsyncClient) -> None:
    assert signed_out(await browser.get("/dashboard/sandboxes"))
    page = await browser.get("/dashboard/sign-in")
    assert page.status_code == 200
    policy = page.headers["content-security-policy"]
    nonce = re.search(r"'nonce-([^']+)'", policy)
    assert nonce is not None and policy == CSP.format(nonce=nonce.group(1))
    assert f'name="style-nonce" content="{nonce.group(1)}"' in page.text
    again = await browser.get("/dashboard/sign-in")
    assert again.headers["content-security-policy"] != policy  # a nonce per answer
    signed_in = await browser.post("/dashboard/sign-in", data={"key": KEY})
    assert signed_in.status_code == 303
    cookie = signed_in.headers["set-cookie"].lower()
    for attribute in ("httponly", "samesite=strict", "path=/dashboard"):
        assert attribute in cookie
    listed = await browser.get("/dashboard/sandboxes")
    assert listed.status_code == 200
    assert "Sign out" in listed.text
    assert KEY not in listed.text  # the key stays on the server


async def test_a_wrong_key_is_refused(browser: httpx.AsyncClient) -> None:
    refused = await browser.post("/dashboard/sign-in", data={"key": "e2b_" + "0" * 40})
    assert refused.status_code == 401
    assert "Invalid API key" in refused.text
    assert "set-cookie" not in refused.headers
    empty = await browser.post("/dashboard/sign-in", data={"key": " "})
    assert empty.status_code == 400


async def test_signing_out_ends_the_session(browser: httpx.AsyncClient) -> None:
    csrf = await sign_in(browser)
    token = browser.cookies[COOKIE]
    out = await browser.post("/dashboard/sign-out", data={"csrf": csrf})
    assert signed_out(out)
    # The old cookie, sent again, names no session any more.
    browser.cookies.clear()
    again = await browser.get("/dashboard/sandboxes", headers={"Cookie": f"{COOKIE}={token}"})
    assert signed_out(again)


async def test_a_revoked_key_ends_its_sessions(site: Site, browser: httpx.AsyncClient) -> None:
    await sign_in(browser, SECOND_KEY)
    second = next(k for k in site.keys.list() if k.name == "second")
    assert (await site.api.delete(f"/api-keys/{second.id}")).status_code == 204
    assert signed_out(await browser.get("/dashboard/sandboxes"))
    # Ended, not only refused once: the session is gone from the server.
    assert await site.dashboard.sessions.find(browser.cookies.get(COOKIE)) is None


async def test_changes_need_the_csrf_token_and_the_same_origin(
    site: Site, browser: httpx.AsyncClient
) -> None:
    sandbox_id = await site.create()
    csrf = await sign_in(browser)
    kill = f"/dashboard/sandboxes/{sandbox_id}/kill"
    missing = await browser.post(kill)
    assert missing.status_code == 403
    assert missing.json()["code"] == 403
    wrong = await browser.post(kill, data={"csrf": csrf[::-1]})
    assert wrong.status_code == 403
    cross_site = await browser.post(
        kill, data={"csrf": csrf}, headers={"Sec-Fetch-Site": "cross-site"}
    )
    assert cross_site.status_code == 403
    other_origin = await browser.post(
        kill, data={"csrf": csrf}, headers={"Origin": "http://evil.example"}
    )
    assert other_origin.status_code == 403
    sign_in_from_elsewhere = await browser.post(
        "/dashboard/sign-in", data={"key": KEY}, headers={"Origin": "http://evil.example"}
    )
    assert sign_in_from_elsewhere.status_code == 403
    assert (await site.api.get(f"/sandboxes/{sandbox_id}")).status_code == 200
    killed = await browser.post(kill, data={"csrf": csrf, "back": "https://evil.example/"})
    assert killed.status_code == 303
    assert killed.headers["location"] == "/dashboard/sandboxes"
    assert (await site.api.get(f"/sandboxes/{sandbox_id}")).status_code == 404


async def test_the_list_filters_and_acts_through_the_api(
    site: Site, browser: httpx.AsyncClient
) -> None:
    red = await site.create(color="red")
    blue = await site.create(color="blue")
    csrf = await sign_in(browser)
    listed = await browser.get("/dashboard/sandboxes")
    assert red in listed.text and blue in listed.text
    filtered = await browser.get("/dashboard/sandboxes", params={"metadata": "color=red"})
    assert red in filtered.text and blue not in filtered.text
    bad = await browser.get("/dashboard/sandboxes", params={"state": "gone"})
    assert bad.status_code == 400
    assert bad.json()["message"].startswith("state:")
    base = f"/dashboard/sandboxes/{red}"
    back = "/dashboard/sandboxes?state=paused"
    paused = await browser.post(base + "/pause", data={"csrf": csrf, "back": back})
    assert paused.headers["location"] == back
    assert red in (await browser.get(back)).text
    # The API's refusal, shown as it gave it: a paused sandbox cannot be paused again.
    again = await browser.post(base + "/pause", data={"csrf": csrf})
    assert again.status_code == 409
    assert "409" in again.text
    bad_timeout = await browser.post(base + "/timeout", data={"csrf": csrf, "timeout": "x"})
    assert bad_timeout.status_code == 400
    resumed = await browser.post(base + "/resume", data={"csrf": csrf})
    assert resumed.status_code == 303
    timeout = await browser.post(base + "/timeout", data={"csrf": csrf, "timeout": "5000"})
    assert timeout.status_code == 303
    forked = await browser.post(base + "/fork", data={"csrf": csrf})
    assert forked.status_code == 303
    children = [s for s in (await site.api.get("/sandboxes")).json() if s["sandboxID"] != red]
    assert len(children) == 2  # blue, and the fork of red
    detail = (await site.api.get(f"/sandboxes/{red}")).json()
    assert detail["state"] == "running"
    unknown = await browser.post(base + "/explode", data={"csrf": csrf})
    assert unknown.status_code == 404


async def test_the_live_list_streams_rows(site: Site, browser: httpx.AsyncClient) -> None:
    await sign_in(browser)
    sandbox_id = await site.create()
    live = await browser.get("/dashboard/sandboxes/live")
    assert live.headers["content-type"].startswith("text/event-stream")
    assert "event: rows" in live.text
    assert sandbox_id in live.text


async def test_the_api_is_still_served_beside_the_dashboard(site: Site) -> None:
    assert (await site.api.get("/health")).status_code == 204
    assert (await site.api.get("/sandboxes")).status_code == 200
    static = await site.api.get("/dashboard/static/dashboard.js")
    assert static.status_code == 200
    assert static.headers["content-security-policy"].startswith("default-src 'self';")
