"""A simulated internet for end-to-end network tests: a namespace of its own, joined to the
server's namespace by a veth and made its default route, with web servers on public-looking
addresses (documentation ranges, routed nowhere) and on addresses sandboxes must never reach
(cloud metadata, a private host). No packet leaves the machine: the server's namespace has no
other way out.

`python -m tests.e2e.internet ADDRESS...` is the web server: port 80 of each address answers
every GET with the address it was reached at, so a test sees which host it got to.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

UPLINK_IP = "203.0.113.1"
GATEWAY_IP = "203.0.113.2"
# Reachable by sandboxes unless their rules say otherwise.
PUBLIC = ("198.51.100.10", "198.51.100.20")
# Unreachable from any sandbox whatever its rules (network/reserved.py).
INTERNAL = ("169.254.169.254", "10.250.0.9")


@dataclass(frozen=True)
class Internet:
    netns: str
    public: tuple[str, ...] = PUBLIC
    internal: tuple[str, ...] = INTERNAL


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def simulated_internet(server_ns: str) -> Iterator[Internet]:
    inet = Internet(f"aenvinet{secrets.token_hex(3)}")
    web: subprocess.Popen[bytes] | None = None
    try:
        _ip("netns", "add", inet.netns)
        _ip("-n", inet.netns, "link", "set", "lo", "up")
        _ip("-n", server_ns, "link", "add", "uplink", "type", "veth",
            "peer", "eth0", "netns", inet.netns)  # fmt: skip
        _ip("-n", server_ns, "addr", "add", f"{UPLINK_IP}/30", "dev", "uplink")
        _ip("-n", inet.netns, "addr", "add", f"{GATEWAY_IP}/30", "dev", "eth0")
        for address in (*inet.public, *inet.internal):
            _ip("-n", inet.netns, "addr", "add", f"{address}/32", "dev", "lo")
        _ip("-n", server_ns, "link", "set", "uplink", "up")
        _ip("-n", inet.netns, "link", "set", "eth0", "up")
        _ip("-n", server_ns, "route", "add", "default", "via", GATEWAY_IP)
        web = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{inet.netns}", "--", sys.executable, "-m",
             "tests.e2e.internet", *inet.public, *inet.internal],
            stdout=subprocess.PIPE, cwd=REPO,
        )  # fmt: skip
        assert web.stdout is not None and web.stdout.readline() == b"ready\n"
        yield inet
    finally:
        if web is not None:
            web.kill()
            web.wait()
        # Deleting the namespace removes the veth, both ends, and the server's route with it.
        subprocess.run(["ip", "netns", "del", inet.netns], capture_output=True, check=False)


class _Named(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = self.server.server_address[0].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return


def _serve(addresses: list[str]) -> None:
    servers = [ThreadingHTTPServer((address, 80), _Named) for address in addresses]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    _serve(sys.argv[1:])
