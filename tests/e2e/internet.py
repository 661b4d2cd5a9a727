"""A simulated internet for end-to-end network tests: a namespace of its own, joined to the
server's namespace by a veth and made its default route, with web servers on public-looking
addresses (documentation ranges, routed nowhere), a resolver for their names and for the
node's domain (`NODE_DOMAIN`, every name at the server's loopback address), addresses
sandboxes must never reach (cloud metadata, a private host) and a SOCKS5 proxy (`SOCKS_IP`).
No packet leaves the machine: the
server's namespace has no other way out. A test CA (`Certificates`) signs the internet's HTTPS
certificates and the node's.

`python -m tests.e2e.internet CERT KEY ADDRESS...` runs the servers: port 80 (HTTP) and 443
(HTTPS, with CERT and KEY) of each address answer every GET with the address they were reached
at, so a test sees which host it got to, except under `/debian/`, where they serve a Debian
package index (`APT_SOURCE`, one package: `APT_PACKAGE`); RESOLVER_IP:53 and
NODE_RESOLVER_IP:53 answer `NAMES` (a `*.` entry covers every name below it) and NXDOMAIN for
the rest. NODE_RESOLVER_IP is a private address, as a cloud host's resolver is: the node asks
it, sandboxes may not.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import secrets
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import cast

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import trustme

from aenv.config import REGISTRIES
from tests.support.socks_server import socks_server

REPO = Path(__file__).resolve().parents[2]

UPLINK_IP = "203.0.113.1"
GATEWAY_IP = "203.0.113.2"
# Reachable by sandboxes unless their rules say otherwise.
PUBLIC = ("198.51.100.10", "198.51.100.20")
# Unreachable from any sandbox whatever its rules (network/reserved.py).
INTERNAL = ("169.254.169.254", "10.250.0.9")
RESOLVER_IP = "198.51.100.53"
# The node's resolver (AENV_NETWORK_DNS): in a private range, as a VPC's resolver is.
NODE_RESOLVER_IP = "10.250.0.53"
# A SOCKS5 server (tests/support/socks_server.py) for sandboxes' own egress proxy; its
# connections leave from its own address, and it resolves `allowed.test` elsewhere than the
# resolver does (PUBLIC[1]), so a test sees that a name went through it as a name.
SOCKS_IP = "198.51.100.80"
SOCKS_NAMES = {"allowed.test": PUBLIC[1]}
NODE_DOMAIN = "aenv.test"
# The internet's hosts; the node's names resolve to the server's loopback address (the clients
# run in the server's namespace).
WEB_NAMES = {"allowed.test": PUBLIC[0], "*.wild.test": PUBLIC[1], "other.test": PUBLIC[0]}
NAMES = {**WEB_NAMES, f"*.{NODE_DOMAIN}": "127.0.0.1"}
# The package registries a node's builds reach by default (`aenv.config.REGISTRIES`), hosted
# here: a node in its default configuration resolves them through the internet's resolver.
REGISTRY_NAMES = {name: PUBLIC[0] for name in (*REGISTRIES, "deb.debian.org")}
NAMES = {**NAMES, **REGISTRY_NAMES}
# A flat Debian repository at every web address, for apt in template builds:
# `deb [trusted=yes] http://allowed.test/debian ./`. Its one package is a real .deb that
# installs `APT_PACKAGE_FILE` (made with dpkg-deb when the internet starts).
APT_SOURCE = "deb [trusted=yes] http://allowed.test/debian ./"
APT_PACKAGE = "aenv-probe"
APT_PACKAGE_FILE = f"/usr/share/{APT_PACKAGE}/installed"
_DEB = f"{APT_PACKAGE}_1.0_all.deb"


def _apt_repo() -> dict[str, bytes]:
    """The repository's files by path: the package, its index and the release file."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "pkg"
        (root / "DEBIAN").mkdir(parents=True)
        (root / "DEBIAN" / "control").write_text(
            f"Package: {APT_PACKAGE}\nVersion: 1.0\nArchitecture: all\n"
            "Maintainer: aenv <aenv@allowed.test>\nDescription: a package for build tests\n"
        )
        installed = root / APT_PACKAGE_FILE.lstrip("/")
        installed.parent.mkdir(parents=True)
        installed.write_text("installed\n")
        deb = Path(tmp) / _DEB
        subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(deb)],
                       check=True, capture_output=True)  # fmt: skip
        package = deb.read_bytes()
    packages = (
        f"Package: {APT_PACKAGE}\nVersion: 1.0\nArchitecture: all\n"
        f"Maintainer: aenv <aenv@allowed.test>\nFilename: {_DEB}\nSize: {len(package)}\n"
        f"SHA256: {hashlib.sha256(package).hexdigest()}\nDescription: a package for build tests\n\n"
    ).encode()
    release = (
        "Origin: aenv-test\nSuite: stable\nCodename: aenv\nDate: Thu, 01 Jan 2026 00:00:00 UTC\n"
        f"SHA256:\n {hashlib.sha256(packages).hexdigest()} {len(packages)} Packages\n"
    ).encode()
    return {"/debian/Packages": packages, "/debian/Release": release, f"/debian/{_DEB}": package}


@dataclass(frozen=True)
class Certificates:
    """PEM files from one test CA: its own certificate, the internet's web servers' pair
    (`web*`) and the node's (`node*`, for `*.NODE_DOMAIN`)."""

    ca: Path
    web: Path
    web_key: Path
    node: Path
    node_key: Path
    # A resolv.conf naming the internet's resolver, for clients that must find the node.
    resolv_conf: Path

    @classmethod
    def make(cls, directory: Path) -> Certificates:
        ca = trustme.CA()
        directory.mkdir(parents=True, exist_ok=True)
        files = cls(*(directory / n for n in ("ca.pem", "web.pem", "web-key.pem", "node.pem",
                                              "node-key.pem", "resolv.conf")))  # fmt: skip
        ca.cert_pem.write_to_path(str(files.ca))
        for names, cert_path, key_path in (
            (list(WEB_NAMES), files.web, files.web_key),
            ([f"*.{NODE_DOMAIN}"], files.node, files.node_key),
        ):
            issued = ca.issue_cert(*names)
            issued.private_key_pem.write_to_path(str(key_path))
            issued.cert_chain_pems[0].write_to_path(str(cert_path))
        files.resolv_conf.write_text(f"nameserver {RESOLVER_IP}\n")
        return files


@dataclass(frozen=True)
class Internet:
    netns: str
    certificates: Certificates


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _wire(server_ns: str, netns: str) -> None:
    _ip("netns", "add", netns)
    _ip("-n", netns, "link", "set", "lo", "up")
    _ip("-n", server_ns, "link", "add", "uplink", "type", "veth", "peer", "eth0", "netns", netns)
    _ip("-n", server_ns, "addr", "add", f"{UPLINK_IP}/30", "dev", "uplink")
    _ip("-n", netns, "addr", "add", f"{GATEWAY_IP}/30", "dev", "eth0")
    for address in (*PUBLIC, *INTERNAL, RESOLVER_IP, NODE_RESOLVER_IP, SOCKS_IP):
        _ip("-n", netns, "addr", "add", f"{address}/32", "dev", "lo")
    _ip("-n", server_ns, "link", "set", "uplink", "up")
    _ip("-n", netns, "link", "set", "eth0", "up")
    _ip("-n", server_ns, "route", "add", "default", "via", GATEWAY_IP)


@contextmanager
def simulated_internet(server_ns: str, certificates: Certificates) -> Iterator[Internet]:
    """The internet behind `server_ns`, serving with `certificates`."""
    inet = Internet(f"aenvinet{secrets.token_hex(3)}", certificates)
    web: subprocess.Popen[bytes] | None = None
    try:
        _wire(server_ns, inet.netns)
        web = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{inet.netns}", "--", sys.executable, "-m",
             "tests.e2e.internet", str(certificates.web), str(certificates.web_key),
             *PUBLIC, *INTERNAL],
            stdout=subprocess.PIPE, cwd=REPO,
        )  # fmt: skip
        assert web.stdout is not None and web.stdout.readline() == b"ready\n"
        with socks_server(inet.netns, SOCKS_IP, SOCKS_IP, SOCKS_NAMES):
            yield inet
    finally:
        if web is not None:
            web.kill()
            web.wait()
        # Deleting the namespace removes the veth, both ends, and the server's route with it.
        subprocess.run(["ip", "netns", "del", inet.netns], capture_output=True, check=False)


class _Named(BaseHTTPRequestHandler):
    """`/bytes/N`: N zero bytes (for throughput); `/debian/`: the package index; `/headers`:
    the request's headers (JSON pairs, in order); anything else: the address it was reached
    at."""

    def do_GET(self) -> None:
        # apt asks for `/debian/./Release` (the `./` of a flat repository).
        path = posixpath.normpath(self.path)
        if path == "/headers":
            self._send(json.dumps(list(self.headers.items())).encode())
            return
        if path.startswith("/debian/"):
            self._send(APT_REPO.get(path))
            return
        size = int(self.path[len("/bytes/") :]) if self.path.startswith("/bytes/") else None
        host, _ = cast("tuple[str, int]", self.server.server_address)
        body = host.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body) if size is None else size))
        self.end_headers()
        if size is None:
            self.wfile.write(body)
            return
        chunk = bytes(2**20)
        for offset in range(0, size, len(chunk)):
            self.wfile.write(chunk[: size - offset])

    def _send(self, body: bytes | None) -> None:
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return


def _address_of(name: str) -> str | None:
    name = name.lower().rstrip(".")
    for rule, address in NAMES.items():
        if name == rule or (rule.startswith("*.") and name.endswith(rule[1:])):
            return address
    return None


def _resolve_forever(sock: socket.socket) -> None:
    while True:
        data, client = sock.recvfrom(4096)
        query = dns.message.from_wire(data)
        response = dns.message.make_response(query)
        name = query.question[0].name
        address = _address_of(name.to_text())
        if address is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif query.question[0].rdtype == dns.rdatatype.A:
            response.answer.append(dns.rrset.from_text(name, 60, "IN", "A", address))
        sock.sendto(response.to_wire(), client)


# The repository this process serves (set by `_serve`).
APT_REPO: dict[str, bytes] = {}


def _serve(cert: str, key: str, addresses: list[str]) -> None:
    APT_REPO.update(_apt_repo())
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    for address in addresses:
        for port in (80, 443):
            server = ThreadingHTTPServer((address, port), _Named)
            if port == 443:
                server.socket = tls.wrap_socket(server.socket, server_side=True)
            threading.Thread(target=server.serve_forever, daemon=True).start()
    for address in (RESOLVER_IP, NODE_RESOLVER_IP):
        resolver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        resolver.bind((address, 53))
        threading.Thread(target=_resolve_forever, args=(resolver,), daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2], sys.argv[3:])
