"""Webhooks (`/events/webhooks`) over a node on doubles, delivering to a real receiver on
loopback: registration, E2B's signature and headers, retries, order, the queue surviving a
restart, the bound on a queue, and targets a sandbox could not reach."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import ssl
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from ipaddress import IPv4Network, ip_address
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from aenv.api.app import create_api
from aenv.api.keys import KeyStore
from aenv.network.egress_ca import EgressCA
from aenv.orchestrator.webhook_delivery import DeliverySettings, TargetRefused, allowed
from tests.api.conftest import API_KEY, Node
from tests.doubles.node import DoubleNode, double_node
from tests.support import loopback_api
from tests.support.wait import eventually

SECRET = "secret-for-event-signature-verification"
CREATED, PAUSED, RESUMED, KILLED = (
    f"sandbox.lifecycle.{name}" for name in ("created", "paused", "resumed", "killed")
)
ALL = [CREATED, PAUSED, RESUMED, KILLED]
# Deliveries to the loopback receiver, retried at once.
LOOPBACK: dict[str, Any] = {"webhook_internal_allowed": True, "webhook_retry_delay": 0.01}


def verify(secret: str, payload: str, signature: str) -> bool:
    """E2B's documented check of `e2b-signature` (docs: lifecycle-events-webhooks)."""
    expected = base64.b64encode(hashlib.sha256((secret + payload).encode()).digest()).decode()
    return expected.replace("+", "-").replace("/", "_").rstrip("=") == signature


@dataclass
class Receiver:
    """A webhook receiver: answers `fail` 500s first, then 200; keeps every request."""

    fail: int = 0
    requests: list[tuple[dict[str, str], str]] = field(default_factory=list)
    url: str = ""

    async def endpoint(self, request: Request) -> Response:
        body = (await request.body()).decode()
        self.requests.append((dict(request.headers), body))
        if self.fail > 0:
            self.fail -= 1
            return Response(status_code=500)
        return Response(status_code=204)

    def delivered(self) -> list[dict[str, Any]]:
        """The events of the deliveries after the failed ones, in arrival order."""
        return [json.loads(body) for _, body in self.requests]


@asynccontextmanager
async def receiver(fail: int = 0) -> AsyncIterator[Receiver]:
    got = Receiver(fail)
    app = Starlette(routes=[Route("/hook", got.endpoint, methods=["POST"])])
    async with loopback_api.served(app) as url:
        got.url = f"{url}/hook"
        yield got


async def _register(client: httpx.AsyncClient, url: str, events: list[str] = ALL) -> str:
    body = {"name": "hook", "url": url, "events": events, "signatureSecret": SECRET}
    response = await client.post("/events/webhooks", json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


async def test_webhooks_are_registered_listed_changed_and_deleted(node: Node) -> None:
    client = node.client
    webhook_id = await _register(client, "https://hooks.example.com/e2b", [CREATED])
    got = (await client.get(f"/events/webhooks/{webhook_id}")).json()
    assert got["name"] == "hook" and got["enabled"] is True
    assert got["teamId"] == "local" and "teamID" not in got and got["events"] == [CREATED]
    assert "signatureSecret" not in got and SECRET not in json.dumps(got)
    assert [h["id"] for h in (await client.get("/events/webhooks")).json()] == [webhook_id]

    changed = await client.patch(
        f"/events/webhooks/{webhook_id}", json={"enabled": False, "events": [KILLED]}
    )
    assert changed.status_code == 200, changed.text
    assert changed.json()["enabled"] is False and changed.json()["events"] == [KILLED]
    assert changed.json()["url"] == "https://hooks.example.com/e2b"

    assert (await client.delete(f"/events/webhooks/{webhook_id}")).status_code == 200
    assert (await client.get(f"/events/webhooks/{webhook_id}")).status_code == 404
    assert (await client.delete(f"/events/webhooks/{webhook_id}")).status_code == 404
    assert (await client.get("/events/webhooks")).json() == []


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"url": "ftp://hooks.example.com/"}, "url"),
        ({"url": "http://127.0.0.1:8080/"}, "url"),
        ({"url": "http://169.254.169.254/latest"}, "url"),
        ({"url": "http://[::1]/"}, "url"),
        ({"url": "http://10.1.2.3/"}, "url"),
        ({"events": ["sandbox.lifecycle.exploded"]}, "events"),
        ({"events": []}, "events"),
        ({"signatureSecret": ""}, "signatureSecret"),
        ({"headers": {"a": "b"}}, "headers"),
    ],
)
async def test_bad_registrations_are_refused(node: Node, body: dict[str, Any], named: str) -> None:
    full = {"name": "h", "url": "https://hooks.example.com/", "events": [CREATED]}
    full |= {"signatureSecret": SECRET, **body}
    response = await node.client.post("/events/webhooks", json=full)
    assert response.status_code == 400, response.text
    assert named in response.json()["message"]
    assert (await node.client.get("/events/webhooks")).json() == []


def test_targets_a_sandbox_cannot_reach_are_refused() -> None:
    settings = DeliverySettings(4, 1.0, 1.0, False, (IPv4Network("10.11.0.0/16"),))
    for address in ("10.11.0.9", "::ffff:10.11.0.9", "fe80::1", "::1"):
        with pytest.raises(TargetRefused):
            allowed(ip_address(address), settings)
    for address in ("93.184.215.14", "2606:4700::1111"):
        allowed(ip_address(address), settings)
    opened = DeliverySettings(4, 1.0, 1.0, True, (IPv4Network("10.11.0.0/16"),))
    allowed(ip_address("10.11.0.9"), opened)


@pytest.mark.parametrize("settings", [LOOPBACK])
async def test_a_delivery_is_signed_and_retried_until_it_is_taken(node: Node) -> None:
    async with receiver(fail=3) as hooks:
        webhook_id = await _register(node.client, hooks.url, [CREATED])
        sandbox = await node.client.post("/sandboxes", json={"templateID": "base"})
        sandbox_id = sandbox.json()["sandboxID"]
        await eventually(lambda: len(hooks.requests) == 4, "the fourth attempt")

    delivery_ids = set()
    for headers, body in hooks.requests:
        assert headers["e2b-webhook-id"] == webhook_id
        assert headers["e2b-signature-version"] == "v1"
        assert headers["content-type"] == "application/json"
        assert verify(SECRET, body, headers["e2b-signature"])
        assert not verify("another secret", body, headers["e2b-signature"])
        delivery_ids.add(headers["e2b-delivery-id"])
    assert len(delivery_ids) == 4  # one delivery attempted four times: an id per attempt
    assert len({json.loads(body)["id"] for _, body in hooks.requests}) == 1  # one event
    event = hooks.delivered()[-1]
    assert event["type"] == CREATED and event["sandboxId"] == sandbox_id
    listed = (await node.client.get(f"/events/sandboxes/{sandbox_id}")).json()
    assert listed == [event]

    log = (await node.client.get(f"/events/webhooks/{webhook_id}/deliveries")).json()
    assert [(d["state"], d["attempts"], d["lastStatus"]) for d in log] == [("delivered", 4, 204)]
    assert log[0]["eventID"] == event["id"]


@pytest.mark.parametrize("settings", [LOOPBACK | {"webhook_attempts": 2}])
async def test_a_delivery_out_of_attempts_is_logged_failed_and_the_next_goes(
    node: Node,
) -> None:
    async with receiver(fail=2) as hooks:
        webhook_id = await _register(node.client, hooks.url)
        sandbox_id = (await node.client.post("/sandboxes", json={"templateID": "base"})).json()[
            "sandboxID"
        ]
        assert (await node.client.delete(f"/sandboxes/{sandbox_id}")).status_code == 204
        await eventually(lambda: len(hooks.requests) == 3, "the kill's delivery")
    assert [e["type"] for e in hooks.delivered()] == [CREATED, CREATED, KILLED]
    log = (await node.client.get(f"/events/webhooks/{webhook_id}/deliveries")).json()
    assert [(d["state"], d["attempts"]) for d in log] == [("delivered", 1), ("failed", 2)]
    assert log[1]["lastError"] == "answered 500"
    metrics = (await node.client.get("/metrics")).text
    assert 'aenv_webhook_deliveries{state="failed"} 1.0' in metrics
    assert 'aenv_webhook_deliveries{state="delivered"} 1.0' in metrics
    assert 'aenv_webhook_deliveries{state="pending"} 0.0' in metrics
    failed = await node.client.get(
        f"/events/webhooks/{webhook_id}/deliveries", params={"state": "failed"}
    )
    assert [d["id"] for d in failed.json()] == [log[1]["id"]]


@pytest.mark.parametrize("settings", [LOOPBACK])
async def test_each_sandboxs_events_arrive_in_order(node: Node) -> None:
    async with receiver(fail=1) as hooks:
        await _register(node.client, hooks.url)
        ids = []
        for _ in range(2):
            created = await node.client.post("/sandboxes", json={"templateID": "base"})
            ids.append(created.json()["sandboxID"])
        for sandbox_id in ids:
            assert (await node.client.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
            resumed = await node.client.post(f"/sandboxes/{sandbox_id}/resume", json={})
            assert resumed.status_code == 201
            assert (await node.client.delete(f"/sandboxes/{sandbox_id}")).status_code == 204
        await eventually(lambda: len(hooks.requests) == 9, "every event")
    delivered = hooks.delivered()[1:]  # the first answer was a 500, retried
    for sandbox_id in ids:
        mine = [e["type"] for e in delivered if e["sandboxId"] == sandbox_id]
        assert mine == [CREATED, PAUSED, RESUMED, KILLED]


@asynccontextmanager
async def stuck_receiver() -> AsyncIterator[tuple[str, asyncio.Event]]:
    """A receiver that answers nothing until the event is set: its URL and the event."""
    hold = asyncio.Event()

    async def stuck(request: Request) -> Response:
        await hold.wait()
        return Response(status_code=204)

    app = Starlette(routes=[Route("/hook", stuck, methods=["POST"])])
    async with loopback_api.served(app) as url:
        try:
            yield f"{url}/hook", hold
        finally:
            hold.set()


@pytest.mark.parametrize("settings", [LOOPBACK | {"webhook_queue_limit": 2}])
async def test_a_queue_past_its_bound_drops_its_oldest(node: Node) -> None:
    async with stuck_receiver() as (url, _):
        webhook_id = await _register(node.client, url, [CREATED])
        for _ in range(4):
            created = await node.client.post("/sandboxes", json={"templateID": "base"})
            assert created.status_code == 201
        log = (await node.client.get(f"/events/webhooks/{webhook_id}/deliveries")).json()
        assert [d["state"] for d in log] == ["pending", "pending", "dropped", "dropped"]
        assert "queue" in log[-1]["lastError"]


async def test_a_name_resolving_to_loopback_is_refused_at_delivery(node: Node) -> None:
    webhook_id = await _register(node.client, "http://localhost:9/hook", [CREATED])
    assert (await node.client.post("/sandboxes", json={"templateID": "base"})).status_code == 201

    async def failed() -> bool:
        log = (await node.client.get(f"/events/webhooks/{webhook_id}/deliveries")).json()
        return bool(log) and log[0]["state"] == "failed"

    await eventually(failed, "the delivery refused")
    log = (await node.client.get(f"/events/webhooks/{webhook_id}/deliveries")).json()
    assert log[0]["attempts"] == 1 and log[0]["lastError"].startswith("refused:")


def _client(node: DoubleNode) -> httpx.AsyncClient:
    keys = KeyStore(node.config.home / "api-keys.json")
    keys.add(API_KEY, "test")
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_api(node.orchestrator, node.config, keys)),
        base_url="http://node",
        headers={"X-API-KEY": API_KEY},
    )


async def test_a_restart_mid_queue_loses_no_event(tmp_path: Path) -> None:
    """Events queued behind a failing receiver when the node stops are delivered, in order,
    by the restarted node."""
    settings = LOOPBACK | {"webhook_retry_delay": 3600.0}
    async with receiver(fail=1) as hooks:
        async with double_node(tmp_path, **settings) as doubles, _client(doubles) as client:
            await _register(client, hooks.url)
            for _ in range(3):
                record, _ = await doubles.orchestrator.create(doubles.request())
                await doubles.orchestrator.kill(record.id)
            await eventually(lambda: len(hooks.requests) == 1, "the first, failed attempt")
        assert len(hooks.requests) == 1  # the retry waits an hour; the node stopped first
        reopened = doubles.reopen()
        await reopened.orchestrator.start()
        try:
            await eventually(lambda: len(hooks.requests) == 7, "every queued event")
        finally:
            await reopened.orchestrator.close()
            reopened.catalog.close()
    delivered = hooks.delivered()
    assert delivered[0] == delivered[1]  # the failed one, sent again first
    types = [e["type"] for e in delivered[1:]]
    assert types == [CREATED, KILLED] * 3
    assert len({e["id"] for e in delivered[1:]}) == 6


async def test_operations_do_not_wait_for_a_receiver(tmp_path: Path) -> None:
    """A receiver that never answers holds up its deliveries, not the node's operations."""
    async with (
        stuck_receiver() as (url, _),
        double_node(tmp_path, **LOOPBACK) as doubles,
        _client(doubles) as client,
    ):
        webhook_id = await _register(client, url)
        for _ in range(3):
            record, _ = await doubles.orchestrator.create(doubles.request())
            await doubles.orchestrator.kill(record.id)
        log = (await client.get(f"/events/webhooks/{webhook_id}/deliveries")).json()
        assert [d["state"] for d in log] == ["pending"] * 6


@asynccontextmanager
async def tls_receiver(
    tmp_path: Path, name: str
) -> AsyncIterator[tuple[int, list[tuple[str, str]], ssl.SSLContext]]:
    """A receiver on loopback speaking TLS with a certificate for `name` from a CA of the
    test's own: its port, the (Host header, body) pairs it got, and a client context trusting
    that CA."""
    ca = EgressCA(tmp_path / "ca")
    got: list[tuple[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"])).decode()
            got.append((self.headers["Host"], body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    server.socket = ca.server_context(name).wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    trusting = ssl.create_default_context(cadata=ca.cert_pem.decode())
    try:
        yield server.server_address[1], got, trusting
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("settings", [LOOPBACK])
async def test_https_goes_to_the_address_judged_and_checks_the_name(
    node: Node, tmp_path: Path
) -> None:
    dispatcher = node.orchestrator.webhooks
    async with tls_receiver(tmp_path, "localhost") as (port, got, trusting):
        # The node's client, trusting the test's CA besides (the host's store has no such CA).
        await dispatcher.client.aclose()
        dispatcher.client = httpx.AsyncClient(
            verify=trusting, trust_env=False, follow_redirects=False
        )
        named = await _register(node.client, f"https://localhost:{port}/hook", [CREATED])
        # The same receiver by its address: the certificate names `localhost` only.
        by_address = await _register(node.client, f"https://127.0.0.1:{port}/hook", [CREATED])
        assert (
            await node.client.post("/sandboxes", json={"templateID": "base"})
        ).status_code == 201

        async def settled() -> bool:
            logs = [
                (await node.client.get(f"/events/webhooks/{w}/deliveries")).json()
                for w in (named, by_address)
            ]
            return all(log and log[0]["state"] != "pending" for log in logs)

        await eventually(settled, "both deliveries settled")
    [(host, body)] = got
    assert host == f"localhost:{port}" and json.loads(body)["type"] == CREATED
    [failed] = (await node.client.get(f"/events/webhooks/{by_address}/deliveries")).json()
    assert failed["state"] == "failed" and "CERTIFICATE_VERIFY_FAILED" in failed["lastError"]
