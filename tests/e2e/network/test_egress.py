"""Egress rules with the unmodified SDK against real VMs, traffic to the simulated internet
(tests/e2e/internet.py): allow and deny lists at create, `update_network` apply and clear,
rules kept across pause/resume and inherited by forks, internal ranges refused whatever the
rules, a sandbox's own SOCKS5 proxy (`egress_proxy`), and what is not implemented refused with
a 400 naming the field."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox
from e2b.exceptions import InvalidArgumentException, SandboxException
from e2b.sandbox.sandbox_api import (
    SandboxEgressProxyOpts,
    SandboxNetworkOpts,
    SandboxNetworkUpdate,
)

from tests.e2e.internet import INTERNAL, PUBLIC, RESOLVER_IP, SOCKS_IP, SOCKS_NAMES
from tests.e2e.network.conftest import API
from tests.support.socks_server import PASSWORD, PORT, USER

A, B = PUBLIC
REFUSED: list[tuple[SandboxNetworkOpts, str]] = [
    ({"allow_out": ["example.com"]}, "ALL_TRAFFIC"),
    ({"allow_out": ["bad..name"], "deny_out": ["0.0.0.0/0"]}, "allowOut"),
    ({"deny_out": ["not-an-address"]}, "denyOut"),
    ({"deny_out": ["2001:db8::/32"]}, "IPv4"),
    # Header rules apply to connections judged by name (tests/e2e/network/test_header_rules.py).
    ({"rules": {"example.com": [{"transform": {"headers": {"X": "y"}}}]}}, "judged by name"),
    ({"mask_request_host": "bad host"}, "maskRequestHost"),
    ({"egress_proxy": {"address": "proxy.test"}}, "egressProxy"),
    ({"egress_proxy": {"address": f"{INTERNAL[1]}:1080"}}, "a range slots may not reach"),
]


def reached(sandbox: Sandbox, *addresses: str) -> set[str]:
    """The addresses whose web server answered the sandbox (each names itself)."""
    got = set()
    for address in addresses:
        out = sandbox.commands.run(f"curl -s -m 3 http://{address}/ || true").stdout.strip()
        if out == address:
            got.add(address)
    return got


@pytest.fixture
def sandboxes() -> Iterator[list[Sandbox]]:
    made: list[Sandbox] = []
    yield made
    for sandbox in made:
        sandbox.kill()


def test_internal_ranges_are_unreachable_whatever_the_rules(sandboxes: list[Sandbox]) -> None:
    sandbox = Sandbox.create(timeout=120, network={"allow_out": ["0.0.0.0/0"]})
    sandboxes.append(sandbox)
    assert reached(sandbox, *PUBLIC, *INTERNAL) == set(PUBLIC)


def test_rules_at_create_update_pause_and_fork(sandboxes: list[Sandbox]) -> None:
    sandbox = Sandbox.create(timeout=180, network={"allow_out": [A], "deny_out": ["0.0.0.0/0"]})
    sandboxes.append(sandbox)
    assert reached(sandbox, A, B) == {A}
    network = sandbox.get_info().network
    assert network is not None
    assert (network["allow_out"], network["deny_out"]) == ([A], ["0.0.0.0/0"])

    sandbox.update_network({"deny_out": [f"{A}/32"]})
    assert reached(sandbox, A, B) == {B}
    sandbox.update_network({"allow_out": [A], "deny_out": ["198.51.100.0/24"]})
    assert reached(sandbox, A, B) == {A}  # allow wins over deny
    sandbox.update_network({})  # an omitted field is cleared
    assert reached(sandbox, A, B) == {A, B}
    sandbox.update_network({"allow_internet_access": False})
    assert reached(sandbox, A, B) == set()
    assert sandbox.get_info().allow_internet_access is False

    sandbox.update_network({"deny_out": [B]})
    assert sandbox.pause() is True
    sandbox = Sandbox.connect(sandbox.sandbox_id, timeout=180)
    assert reached(sandbox, A, B) == {A}
    children = sandbox.fork(count=1, timeout=120)
    child = children[0]
    assert isinstance(child, Sandbox)
    sandboxes.append(child)
    assert reached(child, A, B) == {A}
    assert child.get_info().network == sandbox.get_info().network


def test_update_of_an_unknown_sandbox_is_404() -> None:
    with pytest.raises(SandboxException, match="not found"):
        Sandbox.update_network("x" * 20, {"deny_out": ["0.0.0.0/0"]})


@pytest.mark.parametrize(("network", "why"), REFUSED)
def test_what_is_not_implemented_is_refused(network: SandboxNetworkOpts, why: str) -> None:
    with pytest.raises((InvalidArgumentException, SandboxException), match=why):
        Sandbox.create(timeout=60, network=network)


def test_unknown_network_fields_are_refused() -> None:
    headers = {"X-API-KEY": os.environ["E2B_API_KEY"]}
    body = {"templateID": "base", "network": {"allowOut": [], "somethingNew": True}}
    response = httpx.post(f"{API}/sandboxes", json=body, headers=headers)
    assert response.status_code == 400
    assert "somethingNew" in response.json()["message"]
    response = httpx.put(
        f"{API}/sandboxes/{'x' * 20}/network", json={"denyOut": ["example.com"]}, headers=headers
    )
    assert response.status_code == 400 and "denyOut" in response.json()["message"]


def test_domain_rules_for_http_https_and_dns(sandboxes: list[Sandbox]) -> None:
    rules: SandboxNetworkOpts = {
        "allow_out": ["allowed.test", "*.wild.test"],
        "deny_out": ["0.0.0.0/0"],
    }
    sandbox = Sandbox.create(timeout=120, network=rules)
    sandboxes.append(sandbox)
    sandbox.files.write("/tmp/ca.pem", Path(os.environ["SSL_CERT_FILE"]).read_text())

    def fetch(args: str) -> str:
        run = f"curl -s -m 5 --cacert /tmp/ca.pem {args} || true"
        return sandbox.commands.run(run).stdout.strip()

    assert fetch("http://allowed.test/") == A
    assert fetch("https://allowed.test/") == A
    assert fetch("https://x.wild.test/") == B  # the test certificate's wildcard: one label
    assert fetch("http://deep.x.wild.test/") == B
    assert fetch("http://wild.test/") == ""  # a wildcard covers the names below only
    # DNS answers agree with the rules: a name not allowed does not resolve.
    assert fetch("http://other.test/") == ""
    hosts = sandbox.commands.run("getent hosts allowed.test other.test || true").stdout
    assert A in hosts and "other.test" not in hosts
    # Resolved elsewhere and sent to an allowed address, a name not allowed is still refused.
    assert fetch(f"--resolve other.test:443:{A} https://other.test/") == ""

    sandbox.update_network({"allow_out": ["other.test"], "deny_out": ["0.0.0.0/0"]})
    assert fetch(f"--resolve allowed.test:443:{A} https://allowed.test/") == ""
    assert fetch(f"--resolve other.test:443:{A} https://other.test/") == A
    sandbox.update_network({})
    assert fetch(f"--resolve other.test:443:{A} https://other.test/") == A
    assert fetch(f"http://{B}/") == B


def test_an_egress_proxy_tunnels_what_the_rules_allow(sandboxes: list[Sandbox]) -> None:
    proxy: SandboxEgressProxyOpts = {
        "address": f"{SOCKS_IP}:{PORT}",
        "username": USER,
        "password": PASSWORD,
    }
    sandbox = Sandbox.create(timeout=300, network={"deny_out": [B], "egress_proxy": proxy})
    sandboxes.append(sandbox)
    assert reached(sandbox, A, B) == {A}
    network = sandbox.get_info().network
    assert network is not None
    assert network["egress_proxy"] == {"address": f"{SOCKS_IP}:{PORT}", "username": USER}

    # A name the rules allow reaches the proxy as a name, and the proxy resolves it: to another
    # address than the sandbox's resolver gave.
    named: SandboxNetworkUpdate = {
        "allow_out": ["allowed.test"],
        "deny_out": ["0.0.0.0/0"],
        "egress_proxy": proxy,
    }
    sandbox.update_network(named)
    assert SOCKS_NAMES["allowed.test"] == B

    def fetch(url: str) -> str:
        return sandbox.commands.run(f"curl -s -m 5 {url} || true").stdout.strip()

    assert fetch("http://allowed.test/") == B
    assert fetch(f"http://{A}/") == ""

    # Fails closed: refused credentials do not send the traffic out directly, nor does TLS to
    # a proxy that speaks plaintext. The CA certificate is not shown back, the server name is.
    sandbox.update_network({"egress_proxy": {**proxy, "password": "wrong"}})
    assert reached(sandbox, A, B) == set()
    ca = Path(os.environ["SSL_CERT_FILE"]).read_text()
    tls: SandboxEgressProxyOpts = {**proxy, "tls": {"server_name": "socks.test", "ca_cert": ca}}
    sandbox.update_network({"egress_proxy": tls})
    assert reached(sandbox, A, B) == set()
    network = sandbox.get_info().network
    assert network is not None
    assert network["egress_proxy"].get("tls") == {"server_name": "socks.test"}

    # Kept across pause and resume; an update without it sends traffic out directly again.
    sandbox.update_network(named)
    assert sandbox.pause() is True
    sandbox = Sandbox.connect(sandbox.sandbox_id, timeout=300)
    assert fetch("http://allowed.test/") == B
    sandbox.update_network({"allow_out": ["allowed.test"], "deny_out": ["0.0.0.0/0"]})
    assert fetch("http://allowed.test/") == A


def test_dns_servers_of_domain_rules(sandboxes: list[Sandbox]) -> None:
    rules: SandboxNetworkOpts = {
        "allow_out": ["allowed.test"],
        "deny_out": ["0.0.0.0/0"],
        "dns_servers": [],
    }
    sandbox = Sandbox.create(timeout=120, network=rules)
    sandboxes.append(sandbox)

    def lookup() -> str:
        return sandbox.commands.run("getent hosts allowed.test || true").stdout

    assert lookup() == ""  # no resolver at all

    def update(servers: list[str]) -> None:
        named: SandboxNetworkUpdate = {"allow_out": ["allowed.test"], "deny_out": ["0.0.0.0/0"]}
        sandbox.update_network({**named, "dns_servers": servers})

    # Only the node's resolver may be in a range sandboxes may not reach (it is, here).
    with pytest.raises((InvalidArgumentException, SandboxException), match=INTERNAL[0]):
        update([INTERNAL[0], RESOLVER_IP])
    assert lookup() == ""
    update([RESOLVER_IP])
    assert A in lookup()
    network = sandbox.get_info().network
    assert network is not None and network["dns_servers"] == [RESOLVER_IP]
