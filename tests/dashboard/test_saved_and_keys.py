"""The snapshots, volumes and API keys pages over HTTP: each lists what the API lists, and its
actions change it through the API."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.dashboard.conftest import Site, page_client
from tests.dashboard.test_sessions import sign_in


@pytest.fixture
async def browser(site: Site) -> AsyncIterator[httpx.AsyncClient]:
    async with page_client(site.dashboard) as client:
        yield client


async def test_a_snapshot_starts_a_sandbox_and_is_deleted(
    site: Site, browser: httpx.AsyncClient
) -> None:
    csrf = await sign_in(browser)
    assert "No snapshots." in (await browser.get("/dashboard/snapshots")).text
    sandbox_id = await site.create()
    taken = await site.api.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": "saved"})
    assert taken.status_code == 201, taken.text
    snapshot_id = taken.json()["snapshotID"]
    listed = await browser.get("/dashboard/snapshots")
    assert f'data-snapshot="{snapshot_id}"' in listed.text and "saved" in listed.text
    base = f"/dashboard/snapshots/{snapshot_id}"
    started = await browser.post(base + "/start", data={"csrf": csrf})
    assert started.status_code == 303
    new_id = started.headers["location"].rsplit("/", 1)[1]
    assert (await site.api.get(f"/sandboxes/{new_id}")).json()["templateID"] == snapshot_id
    assert (await browser.post(base + "/explode", data={"csrf": csrf})).status_code == 404
    assert (await browser.post(base + "/delete")).status_code == 403  # no CSRF token
    deleted = await browser.post(base + "/delete", data={"csrf": csrf})
    assert deleted.status_code == 303
    assert snapshot_id not in (await browser.get("/dashboard/snapshots")).text


async def test_volumes_are_created_and_deleted(site: Site, browser: httpx.AsyncClient) -> None:
    csrf = await sign_in(browser)
    created = await browser.post("/dashboard/volumes", data={"csrf": csrf, "name": "data"})
    assert created.status_code == 303, created.text
    (volume,) = (await site.api.get("/volumes")).json()
    listed = await browser.get("/dashboard/volumes")
    assert f'data-volume="{volume["volumeID"]}"' in listed.text
    # The API's refusal, shown as it gave it.
    bad = await browser.post("/dashboard/volumes", data={"csrf": csrf, "name": "no/slash"})
    assert bad.status_code == 400
    path = f"/dashboard/volumes/{volume['volumeID']}/delete"
    assert (await browser.post(path, data={"csrf": csrf})).status_code == 303
    assert (await site.api.get("/volumes")).json() == []


async def test_a_new_key_is_shown_once_and_revoked(site: Site, browser: httpx.AsyncClient) -> None:
    csrf = await sign_in(browser)
    created = await browser.post("/dashboard/keys", data={"csrf": csrf, "name": "ci"})
    assert created.status_code == 200
    value = re.search(r'<code id="new-key">(e2b_[0-9a-f]{40})</code>', created.text)
    assert value is not None
    assert (await site.api.get("/sandboxes", headers={"X-API-KEY": value.group(1)})).is_success
    listed = await browser.get("/dashboard/keys")
    assert value.group(1) not in listed.text  # masked from then on
    ci = next(k for k in site.keys.list() if k.name == "ci")
    assert f'data-key="{ci.id}"' in listed.text
    revoked = await browser.post(f"/dashboard/keys/{ci.id}/revoke", data={"csrf": csrf})
    assert revoked.status_code == 303
    assert not (await site.api.get("/sandboxes", headers={"X-API-KEY": value.group(1)})).is_success


async def test_a_volumes_files_are_browsed_and_downloaded(
    site: Site, browser: httpx.AsyncClient
) -> None:
    await sign_in(browser)
    volume = (await site.api.post("/volumes", json={"name": "files"})).json()
    volume_id, token = volume["volumeID"], volume["token"]
    content = bytes(range(256)) * 400
    put = await site.api.put(
        f"/volumecontent/{volume_id}/file",
        params={"path": "/dir/data.bin", "force": "true"},
        headers={"Authorization": f"Bearer {token}"},
        content=content,
    )
    assert put.status_code == 201, put.text
    base = f"/dashboard/volumes/{volume_id}/files"
    root = await browser.get(base)
    assert root.status_code == 200
    assert 'data-file="dir"' in root.text
    inside = await browser.get(base, params={"path": "/dir"})
    assert 'data-file="data.bin"' in inside.text and str(len(content)) in inside.text
    downloaded = await browser.get(base + "/download", params={"path": "/dir/data.bin"})
    assert downloaded.status_code == 200 and downloaded.content == content
    assert "attachment" in downloaded.headers["content-disposition"]
    assert (await browser.get(base, params={"path": "dir"})).status_code == 400
    assert (await browser.get(base, params={"path": "/nope"})).status_code == 404
    missing = await browser.get("/dashboard/volumes/nosuchvolume/files")
    assert missing.status_code == 404
