"""Private ingress with the unmodified SDK against real VMs: `allow_public_traffic=False` issues
a traffic access token that the proxy requires on user ports (envd keeps its own token),
`mask_request_host` is the Host a sandbox's service sees, and `https_ports` are reached over
TLS (a self-signed certificate in the guest)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import trustme
from e2b import Sandbox

from tests.e2e.network.conftest import sandbox_url

PORT = 8000
HTTPS_PORT = 8443
# Answers every GET with the Host header it received; on HTTPS_PORT over TLS, with the
# certificate and key files given as arguments.
HOST_ECHO = """
import http.server
import ssl
import sys

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (self.headers.get("Host") or "").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

server = http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Handler)
if len(sys.argv) > 2:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(sys.argv[2], sys.argv[3])
    server.socket = context.wrap_socket(server.socket, server_side=True)
server.serve_forever()
"""


def start_host_echo(sandbox: Sandbox, port: int = PORT, tls: bool = False) -> None:
    sandbox.files.write("/tmp/host_echo.py", HOST_ECHO)
    args, scheme = str(port), "http"
    if tls:  # a certificate no one trusts, as a developer's own would be
        issued = trustme.CA().issue_cert("localhost")
        sandbox.files.write("/tmp/cert.pem", issued.cert_chain_pems[0].bytes().decode())
        sandbox.files.write("/tmp/key.pem", issued.private_key_pem.bytes().decode())
        args, scheme = f"{port} /tmp/cert.pem /tmp/key.pem", "https"
    sandbox.commands.run(f"python3 /tmp/host_echo.py {args}", background=True)
    sandbox.commands.run(
        f"for i in $(seq 100); do curl -sk -o /dev/null {scheme}://localhost:{port} && exit 0;"
        " sleep 0.1; done; exit 1"
    )


def get(sandbox: Sandbox, token: str | None = None, port: int = PORT) -> httpx.Response:
    """A GET of the sandbox's service by its host name, as a browser would send it (with a
    traffic access token, if given)."""
    headers = {} if token is None else {"e2b-traffic-access-token": token}
    return httpx.get(f"{sandbox_url(sandbox.sandbox_id, port)}/", headers=headers, timeout=30)


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
    assert get(private, "wrong").status_code == 403
    answer = get(private, token)
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
    assert get(resumed, token).status_code == 200


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


def test_an_https_port_is_reached_over_tls() -> None:
    sandbox = Sandbox.create(timeout=120, network={"https_ports": [HTTPS_PORT]})
    plain = Sandbox.create(timeout=120)
    try:
        for each in (sandbox, plain):
            start_host_echo(each, HTTPS_PORT, tls=True)
        answer = get(sandbox, port=HTTPS_PORT)
        host = sandbox_url(sandbox.sandbox_id, HTTPS_PORT).removeprefix("https://")
        assert (answer.status_code, answer.text) == (200, host)
        info = sandbox.get_info().network
        assert info is not None and info["https_ports"] == [HTTPS_PORT]
        # Without the setting the proxy speaks plain HTTP to the port, which TLS refuses.
        assert get(plain, port=HTTPS_PORT).status_code == 502
    finally:
        sandbox.kill()
        plain.kill()
