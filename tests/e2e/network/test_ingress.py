"""Private ingress with the unmodified SDK against real VMs: `allow_public_traffic=False` issues
a traffic access token that the proxy requires on user ports (envd keeps its own token), and
`mask_request_host` is the Host a sandbox's service sees."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox

from tests.e2e.network.conftest import sandbox_url

PORT = 8000
# Answers every GET with the Host header it received.
HOST_ECHO = """
import http.server

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (self.headers.get("Host") or "").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

http.server.ThreadingHTTPServer(("0.0.0.0", 8000), Handler).serve_forever()
"""


def start_host_echo(sandbox: Sandbox) -> None:
    sandbox.files.write("/tmp/host_echo.py", HOST_ECHO)
    sandbox.commands.run("python3 /tmp/host_echo.py", background=True)
    sandbox.commands.run(
        f"for i in $(seq 100); do curl -s -o /dev/null localhost:{PORT} && exit 0; sleep 0.1; done;"
        " exit 1"
    )


def get(sandbox: Sandbox, **headers: str) -> httpx.Response:
    """A GET of the sandbox's service by its host name, as a browser would send it."""
    return httpx.get(f"{sandbox_url(sandbox.sandbox_id, PORT)}/", headers=headers, timeout=30)


@pytest.fixture
def private() -> Iterator[Sandbox]:
    sandbox = Sandbox.create(
        timeout=120,
        network={"allow_public_traffic": False, "mask_request_host": "masked.test:${PORT}"},
    )
    try:
        start_host_echo(sandbox)
        yield sandbox
    finally:
        sandbox.kill()


def test_private_sandbox_needs_its_token_and_sees_the_masked_host(private: Sandbox) -> None:
    token = private.traffic_access_token
    assert token
    assert get(private).status_code == 403
    assert get(private, **{"e2b-traffic-access-token": "wrong"}).status_code == 403
    answer = get(private, **{"e2b-traffic-access-token": token})
    assert (answer.status_code, answer.text) == (200, f"masked.test:{PORT}")
    # The SDK's own calls go to envd, which checks the envd token instead.
    assert private.commands.run("echo ok").stdout == "ok\n"
    info = private.get_info().network
    assert info is not None
    assert (info["allow_public_traffic"], info["mask_request_host"]) == (
        False,
        "masked.test:${PORT}",
    )
    # A resumed sandbox keeps its token.
    assert private.pause() is True
    resumed = Sandbox.connect(private.sandbox_id, timeout=120)
    assert resumed.traffic_access_token == token
    start_host_echo(resumed)
    assert get(resumed).status_code == 403
    assert get(resumed, **{"e2b-traffic-access-token": token}).status_code == 200


def test_public_sandbox_needs_no_token() -> None:
    sandbox = Sandbox.create(timeout=120)
    try:
        assert sandbox.traffic_access_token is None
        start_host_echo(sandbox)
        answer = get(sandbox)
        host = sandbox_url(sandbox.sandbox_id, PORT).removeprefix("https://")
        assert (answer.status_code, answer.text) == (200, host)
        assert sandbox.get_host(PORT) == host
    finally:
        sandbox.kill()
