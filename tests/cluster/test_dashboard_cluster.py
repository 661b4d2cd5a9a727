"""The dashboard of a gateway, against a real redis-server and a node on loopback: the node's
real API app (on doubles) behind its internal gate and data-plane proxy, whose sandboxes' envd
is our envd in a throwaway root (as tests/dashboard's are). In Chromium: the terminal of a
sandbox on the node, reached through the gateway, runs `echo hi`; the nodes page drains and
undrains the node. Over HTTP: a sandbox's files through the gateway, `GET /nodes` and `POST
/nodes/{nodeID}` and who may call them, and sessions shared by two gateways and kept by a
restarted one, with nothing in Redis that opens them."""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from playwright.async_api import Browser, expect

from aenv import __version__
from aenv.api.app import create_api
from aenv.api.internal_models import INTERNAL_VERSIONS
from aenv.api.keys import KeyStore
from aenv.cluster.drain import Drains
from aenv.cluster.holders import FileKind, FileRef, Holders
from aenv.cluster.internal import InternalGate
from aenv.cluster.keys import ClusterKeys
from aenv.cluster.registry import Capacity, NodeRegistry, NodeReport
from aenv.cluster.routing import Routes
from aenv.cluster.store import connect
from aenv.dashboard.sessions import COOKIE
from aenv.envd import ENVD_PORT
from aenv.orchestrator.catalog import Catalog
from aenv.proxy import SandboxNotFound, SandboxProxy, Upstream
from tests.cluster.shared import SECRET, gateway_over
from tests.dashboard.browser import chromium, new_page, screenshot
from tests.dashboard.test_terminal import prompt, run
from tests.doubles.node import double_node
from tests.support.envd_process import envd_in_throwaway_root
from tests.support.loopback_api import served
from tests.support.ports import free_port
from tests.support.redis_server import RedisServer

NODE = "node-a"
# The one envd's access token, which it requires as a guest's envd does: each sandbox of the
# node is given it (`Cluster.create`), so the gateway must pass the sandbox's token on.
ENVD_TOKEN = "envd-token-of-the-test"


class EnvdResolver:
    """Every sandbox's envd is the one envd on `port`; no other port is open."""

    def __init__(self, port: int) -> None:
        self.port = port

    async def resolve(self, sandbox_id: str, port: int) -> Upstream:
        if port != ENVD_PORT:
            raise SandboxNotFound(sandbox_id)
        return Upstream("127.0.0.1", self.port)


@dataclass
class Cluster:
    url: str  # a gateway's
    other_url: str  # another gateway's, of the same cluster
    key: str  # of the default team
    team_key: str  # of another team
    redis: RedisServer
    client: aioredis.Redis
    catalog: Catalog  # the node's

    def api(self, key: str | None = None) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url, headers={"X-API-Key": key or self.key}, timeout=60
        )

    async def create(self) -> str:
        async with self.api() as api:
            created = await api.post("/sandboxes", json={"templateID": "base"})
        assert created.status_code == 201, created.text
        sandbox_id: str = created.json()["sandboxID"]
        # What the node's agent does for each sandbox it starts (no agent runs here).
        await Routes(self.client).assign(sandbox_id, NODE)
        self.catalog.update(sandbox_id, envd_access_token=ENVD_TOKEN)
        return sandbox_id


@pytest.fixture(scope="module")
def envd_port() -> Iterator[int]:
    port = free_port()
    with envd_in_throwaway_root(port, "--access-token", ENVD_TOKEN):
        yield port


@pytest.fixture
async def cluster(
    tmp_path: Path, redis: RedisServer, client: aioredis.Redis, envd_port: int
) -> AsyncIterator[Cluster]:
    async with AsyncExitStack() as stack:
        node = await stack.enter_async_context(double_node(tmp_path / "node"))
        node_keys = KeyStore(tmp_path / "node-keys.json")
        node_keys.create("node")
        api = create_api(node.orchestrator, node.config, node_keys)
        proxy = SandboxProxy(EnvdResolver(envd_port), control_plane=api)
        stack.push_async_callback(proxy.aclose)
        node_url = await stack.enter_async_context(served(InternalGate(proxy, SECRET)))
        registry = NodeRegistry(client, SECRET)
        capacity = Capacity(cpus=2, memory_mb=1024, memory_free_mb=512, running=0, paused=0)
        report = NodeReport(
            NODE,
            node_url.removeprefix("http://"),
            capacity,
            ["base"],
            internal_versions=INTERNAL_VERSIONS,
        )
        await registry.heartbeat(secrets.token_hex(8), report, ttl=600)
        await Holders(registry).add(NODE, FileRef(FileKind.TEMPLATE, "base"))
        keys = ClusterKeys(client)
        _, key = await keys.new("operator")
        _, team_key = await keys.new("member", "team-other")
        urls = []
        for _ in range(2):
            gateway_client = connect(redis.url, timeout=1.0)
            stack.push_async_callback(gateway_client.aclose)
            gateway = gateway_over(gateway_client)
            stack.push_async_callback(gateway.aclose)
            urls.append(await stack.enter_async_context(served(gateway)))
        yield Cluster(urls[0], urls[1], key, team_key, redis, client, node.catalog)


def pages(url: str) -> httpx.AsyncClient:
    """A browser's requests on the dashboard at `url`, from its own origin."""
    return httpx.AsyncClient(
        base_url=url, headers={"Origin": url, "Sec-Fetch-Site": "same-origin"}, timeout=60
    )


async def sign_in(browser: httpx.AsyncClient, key: str) -> str:
    """Signs in; the session's CSRF token."""
    signed_in = await browser.post("/dashboard/sign-in", data={"key": key})
    assert signed_in.status_code == 303, signed_in.text
    page = await browser.get("/dashboard/sandboxes")
    assert page.status_code == 200
    found = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert found is not None
    return found.group(1)


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with chromium() as browser:
        yield browser


async def test_a_terminal_through_the_gateway(
    cluster: Cluster, browser: Browser, tmp_path: Path
) -> None:
    sandbox_id = await cluster.create()
    async with new_page(browser, viewport={"width": 1200, "height": 900}) as page:
        await page.goto(f"{cluster.url}/dashboard/sign-in")
        await page.fill("#key", cluster.key)
        await page.click(".sign-in button")
        await page.click(f"a[href='/dashboard/sandboxes/{sandbox_id}']")
        await expect(page.locator("#terminal-status")).to_have_text("connected")
        await page.click("#terminal")
        await prompt(page)
        await run(page, "echo hi", "hi")
        await page.keyboard.type("exit")
        await page.keyboard.press("Enter")
        await expect(page.locator("#terminal-status")).to_have_text("the shell exited (0)")
        # Another team's key does not see the sandbox: its session opens no shell.
        await page.goto(f"{cluster.url}/dashboard/sign-in")
        await page.fill("#key", cluster.team_key)
        await page.click(".sign-in button")
        opens = """(url) => new Promise((done) => {
            const s = new WebSocket(url);
            s.onmessage = () => { s.close(1000); done("opened"); };
            s.onclose = (e) => done("closed " + e.code);
        })"""
        socket = cluster.url.replace("http:", "ws:") + f"/dashboard/sandboxes/{sandbox_id}/terminal"
        assert await page.evaluate(opens, socket) == "closed 4404"


async def test_files_through_the_gateway(cluster: Cluster) -> None:
    sandbox_id = await cluster.create()
    base = f"/dashboard/sandboxes/{sandbox_id}/files"
    content = secrets.token_bytes(300_000)
    async with pages(cluster.url) as browser:
        csrf = await sign_in(browser, cluster.key)
        uploaded = await browser.post(
            base + "/upload",
            data={"csrf": csrf, "path": "/home/user"},
            files={"file": ("via-gateway.bin", content)},
        )
        assert uploaded.status_code == 303, uploaded.text
        listed = await browser.get(base, params={"path": "/home/user"})
        assert listed.status_code == 200, listed.text
        assert 'data-file="via-gateway.bin"' in listed.text
        downloaded = await browser.get(
            base + "/download", params={"path": "/home/user/via-gateway.bin"}
        )
        assert downloaded.status_code == 200
        assert downloaded.content == content
        missing = await browser.get(base + "/download", params={"path": "/home/user/nope"})
        assert missing.status_code == 404
        # The sandbox's token is what opens its envd: with another one, nothing is listed.
        cluster.catalog.update(sandbox_id, envd_access_token="another-token")
        wrong = await browser.get(base, params={"path": "/home/user"})
        assert wrong.status_code != 200 and "via-gateway.bin" not in wrong.text
    async with pages(cluster.url) as other_team:
        await sign_in(other_team, cluster.team_key)
        refused = await other_team.get(base, params={"path": "/home/user"})
        assert refused.status_code == 404
        assert "via-gateway.bin" not in refused.text


async def test_nodes_listed_and_drained(cluster: Cluster, browser: Browser, tmp_path: Path) -> None:
    await cluster.create()
    async with cluster.api() as api:
        nodes = (await api.get("/nodes")).json()
        assert [(n["id"], n["status"], n["version"]) for n in nodes] == [
            (NODE, "ready", __version__)
        ]
        assert nodes[0]["sandboxCount"] == 1
        assert nodes[0]["metrics"]["cpuCount"] >= 1
        unknown = await api.post("/nodes/nope", json={"status": "draining"})
        assert unknown.status_code == 404
        bad = await api.post(f"/nodes/{NODE}", json={"status": "gone"})
        assert bad.status_code == 400
        extra = await api.post(f"/nodes/{NODE}", json={"status": "ready", "clusterID": "x"})
        assert extra.status_code == 400 and "clusterID" in extra.text
    async with cluster.api(cluster.team_key) as member:
        assert (await member.get("/nodes")).status_code == 200
        refused = await member.post(f"/nodes/{NODE}", json={"status": "draining"})
        assert refused.status_code == 403
    drains = Drains(cluster.client)
    assert not await drains.is_draining(NODE)
    async with new_page(browser, viewport={"width": 1200, "height": 600}) as page:
        await page.goto(f"{cluster.url}/dashboard/sign-in")
        await page.fill("#key", cluster.key)
        await page.click(".sign-in button")
        await page.goto(f"{cluster.url}/dashboard/nodes")
        row = page.locator(f"tr[data-node='{NODE}']")
        await expect(row.locator(".status")).to_have_text("ready")
        await row.get_by_role("button", name="Drain").click()  # confirmed
        await expect(row.locator(".status")).to_have_text("draining")
        assert await drains.is_draining(NODE)
        await screenshot(page, "nodes", tmp_path)
        await row.get_by_role("button", name="Undrain").click()
        await expect(row.locator(".status")).to_have_text("ready")
        assert not await drains.is_draining(NODE)


async def test_sessions_are_the_clusters(cluster: Cluster) -> None:
    async with pages(cluster.url) as browser:
        refused = await browser.post("/dashboard/sign-in", data={"key": "e2b_" + "0" * 40})
        assert refused.status_code == 401
        cross = await browser.post(
            "/dashboard/sign-in",
            data={"key": cluster.key},
            headers={"Sec-Fetch-Site": "cross-site", "Origin": "http://elsewhere.example"},
        )
        assert cross.status_code == 403
        csrf = await sign_in(browser, cluster.key)
        token = browser.cookies[COOKIE]
    # Redis holds neither the cookie's token nor the key, and no value that opens elsewhere.
    stored = [k async for k in cluster.client.scan_iter("*dashboard-session*")]
    assert len(stored) == 1
    raw = await cluster.client.get(stored[0])
    assert isinstance(raw, str)
    for secret in (token, cluster.key, csrf):
        assert secret not in stored[0] and secret not in raw
    # Another gateway of the cluster knows the session, and so does a restarted one.
    async with pages(cluster.other_url) as browser:
        browser.cookies.set(COOKIE, token)
        page = await browser.get("/dashboard/sandboxes")
        assert page.status_code == 200 and csrf in page.text
    restarted = gateway_over(connect(cluster.redis.url, timeout=1.0))
    async with served(restarted) as url, pages(url) as browser:
        browser.cookies.set(COOKIE, token)
        assert (await browser.get("/dashboard/sandboxes")).status_code == 200
        # Signing out on one gateway ends the session on every one.
        out = await browser.post("/dashboard/sign-out", data={"csrf": csrf})
        assert out.status_code == 303
    await restarted.aclose()
    async with pages(cluster.url) as browser:
        browser.cookies.set(COOKIE, token)
        page = await browser.get("/dashboard/sandboxes")
        assert page.status_code == 303 and page.headers["location"] == "/dashboard/sign-in"
    assert [k async for k in cluster.client.scan_iter("*dashboard-session*")] == []
    # A key revoked ends its sessions at their next request, on any gateway.
    async with cluster.api() as api:
        made = (await api.post("/api-keys", json={"name": "short-lived"})).json()
    async with pages(cluster.url) as browser:
        await sign_in(browser, made["key"])
        await ClusterKeys(cluster.client).revoke(made["id"])
        page = await browser.get("/dashboard/sandboxes")
        assert page.status_code == 303 and page.headers["location"] == "/dashboard/sign-in"
    assert [k async for k in cluster.client.scan_iter("*dashboard-session*")] == []


async def test_a_volumes_files_through_the_gateway(cluster: Cluster) -> None:
    async with cluster.api() as api:
        made = await api.post("/volumes", json={"name": "shared"})
        assert made.status_code == 201, made.text
        volume_id, token = made.json()["volumeID"], made.json()["token"]
        put = await api.put(
            f"/volumecontent/{volume_id}/file",
            params={"path": "/out/result.txt", "force": "true"},
            headers={"Authorization": f"Bearer {token}"},
            content=b"42\n",
        )
        assert put.status_code == 201, put.text
    base = f"/dashboard/volumes/{volume_id}/files"
    async with pages(cluster.url) as browser:
        await sign_in(browser, cluster.key)
        listed = await browser.get(base, params={"path": "/out"})
        assert listed.status_code == 200, listed.text
        assert 'data-file="result.txt"' in listed.text
        downloaded = await browser.get(base + "/download", params={"path": "/out/result.txt"})
        assert downloaded.content == b"42\n"
    async with pages(cluster.url) as other_team:
        await sign_in(other_team, cluster.team_key)
        assert (await other_team.get(base)).status_code == 404


async def test_redis_down_is_a_503_for_a_signed_in_page(cluster: Cluster) -> None:
    async with pages(cluster.url) as browser:
        await sign_in(browser, cluster.key)
        cluster.redis.stop()
        try:
            down = await browser.get("/dashboard/sandboxes")
        finally:
            cluster.redis.start()
    assert down.status_code == 503
    assert down.json()["code"] == 503 and "unavailable" in down.json()["message"]
