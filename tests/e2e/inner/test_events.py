"""Lifecycle events and a webhook with the unmodified SDK against real VMs: a sandbox's
create, timeout change, pause, resume and kill are listed in order by `/events/sandboxes`,
and delivered, signed, to a receiver on the namespace's loopback (which fails once first)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from e2b import Sandbox

from tests.e2e.inner.conftest import BASE

SECRET = "inner-suite-secret"
TYPES = [
    f"sandbox.lifecycle.{name}" for name in ("created", "updated", "paused", "resumed", "killed")
]


class _Receiver(BaseHTTPRequestHandler):
    bodies: list[tuple[str, str]] = []
    fail = 1

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"])).decode()
        if _Receiver.fail > 0:
            _Receiver.fail -= 1
            self.send_response(503)
        else:
            _Receiver.bodies.append((self.headers["e2b-signature"], body))
            self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    finally:
        server.shutdown()
        server.server_close()


def _signed(signature: str, body: str) -> bool:
    digest = hashlib.sha256((SECRET + body).encode()).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=") == signature


def test_lifecycle_events_are_listed_and_delivered_in_order(receiver: str) -> None:
    headers = {"X-API-Key": os.environ["E2B_API_KEY"]}
    with httpx.Client(base_url=BASE, headers=headers, timeout=60) as api:
        hook = api.post(
            "/events/webhooks",
            json={"name": "inner", "url": receiver, "events": TYPES, "signatureSecret": SECRET},
        )
        assert hook.status_code == 201, hook.text
        try:
            sbx = Sandbox.create(timeout=300, metadata={"suite": "events"})
            try:
                sbx.set_timeout(600)
                assert sbx.pause() is True
                sbx = Sandbox.connect(sbx.sandbox_id, timeout=300)
                assert sbx.commands.run("true").exit_code == 0
            finally:
                sbx.kill()
            listed = api.get(f"/events/sandboxes/{sbx.sandbox_id}", params={"orderAsc": "true"})
            events = listed.json()
            assert [e["type"] for e in events] == TYPES
            assert all(e["eventData"]["sandbox_metadata"] == {"suite": "events"} for e in events)
            paused = events[2]["eventData"]["execution"]
            assert paused["execution_time"] > 0 and paused["memory_mb"] > 0

            deadline = time.monotonic() + 60
            while len(_Receiver.bodies) < len(TYPES) and time.monotonic() < deadline:
                time.sleep(0.1)
            mine = [json.loads(body) for _, body in _Receiver.bodies]
            assert [e for e in mine if e["sandboxId"] == sbx.sandbox_id] == events
            assert all(_signed(signature, body) for signature, body in _Receiver.bodies)
        finally:
            api.delete(f"/events/webhooks/{hook.json()['id']}")
