"""A sandbox's files through the dashboard (browse, upload, download) over HTTP, on our envd in
a throwaway root standing for the guest (`real_envd.py`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from tests.dashboard.conftest import Site, page_client
from tests.dashboard.real_envd import dashboard_on
from tests.dashboard.test_sessions import sign_in
from tests.support.envd_process import envd_in_throwaway_root
from tests.support.ports import free_port


@pytest.fixture(scope="module")
def envd_port() -> Iterator[int]:
    port = free_port()
    with envd_in_throwaway_root(port):
        yield port


@pytest.fixture
async def browser(site: Site, envd_port: int) -> AsyncIterator[httpx.AsyncClient]:
    async with (
        dashboard_on(site, envd_port) as dashboard,
        page_client(dashboard) as client,
    ):
        yield client


async def test_upload_browse_and_download(site: Site, browser: httpx.AsyncClient) -> None:
    csrf = await sign_in(browser)
    sandbox_id = await site.create()
    base = f"/dashboard/sandboxes/{sandbox_id}/files"
    content = bytes(range(256)) * 1000
    uploaded = await browser.post(
        base + "/upload",
        data={"csrf": csrf, "path": "/home/user"},
        files={"file": ("data.bin", content)},
    )
    assert uploaded.status_code == 303, uploaded.text
    assert uploaded.headers["location"] == f"{base}?path=%2Fhome%2Fuser"
    listed = await browser.get(base, params={"path": "/home/user"})
    assert listed.status_code == 200
    assert 'data-file="data.bin"' in listed.text and str(len(content)) in listed.text
    downloaded = await browser.get(base + "/download", params={"path": "/home/user/data.bin"})
    assert downloaded.status_code == 200
    assert downloaded.content == content
    assert "attachment" in downloaded.headers["content-disposition"]
    missing = await browser.get(base + "/download", params={"path": "/home/user/nope"})
    assert missing.status_code == 404
    relative = await browser.get(base, params={"path": "home"})
    assert relative.status_code == 400
    no_token = await browser.post(
        base + "/upload", data={"path": "/home/user"}, files={"file": ("x", b"x")}
    )
    assert no_token.status_code == 403
    unknown = await browser.get("/dashboard/sandboxes/nosuchsandbox/files")
    assert unknown.status_code == 404
