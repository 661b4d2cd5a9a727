"""Network settings through the control plane over a node on doubles: what reaches the slot at
create, `PUT /sandboxes/{id}/network` (running, paused, failing), the info, forks, and every
refusal naming its field. Real traffic through these rules is tested in tests/network and
tests/e2e/network."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Iterator
from ipaddress import IPv4Address
from pathlib import Path

import httpx
import pytest
import trustme

from aenv.network import EgressPolicy, NftError, Slot
from aenv.network.socks import SocksProxy
from aenv.orchestrator.states import SandboxState
from tests.api.test_routes import error, served
from tests.doubles.node import DoubleNode, double_node
from tests.doubles.slots import DOUBLE_CA

CA_PEM = trustme.CA().cert_pem.bytes().decode()
# Public-looking addresses (documentation ranges) for egress proxies: nothing is dialled here.
PROXY_IP, OTHER_IP = "198.51.100.7", "203.0.113.9"
# Addresses the node's stand-in host owns (`host_netns`): one on an interface, one in a range
# routed to the host itself.
NODE_IP, NODE_RANGE, NODE_RANGE_IP = "198.51.100.99", "192.0.2.0/24", "192.0.2.77"
RULES = {"allowOut": ["1.1.1.1", "*.example.com"], "denyOut": ["0.0.0.0/0"]}


def slot_of(node: DoubleNode, sandbox_id: str) -> tuple[bool, EgressPolicy]:
    """The egress switch and policy the sandbox's current slot was given."""
    host = node.orchestrator.guest_endpoint(sandbox_id).host
    netns = next(n for n, slot in node.slots.in_use.items() if str(slot.address) == host)
    return node.slots.egress[netns], node.slots.policies.get(netns, EgressPolicy())


async def create(api: httpx.AsyncClient, **body: object) -> str:
    created = await api.post("/sandboxes", json={"templateID": "base", **body})
    assert created.status_code == 201, created.text
    return str(created.json()["sandboxID"])


async def test_rules_at_create_update_pause_and_fork(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        sandbox_id = await create(api, network=RULES)
        enabled, policy = slot_of(node, sandbox_id)
        assert enabled and policy == EgressPolicy.parse(RULES["allowOut"], RULES["denyOut"])
        info = (await api.get(f"/sandboxes/{sandbox_id}")).json()
        assert info["network"] == {**RULES, "allowPublicTraffic": True}
        assert info["allowInternetAccess"] is True

        url = f"/sandboxes/{sandbox_id}/network"
        assert (await api.put(url, json={"allow_internet_access": False})).status_code == 204
        assert slot_of(node, sandbox_id) == (False, EgressPolicy.parse(deny=["0.0.0.0/0"]))
        assert (await api.get(f"/sandboxes/{sandbox_id}")).json()["allowInternetAccess"] is False

        # Paused: stored, and the next slot gets it.
        assert (await api.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
        assert (await api.put(url, json={"denyOut": ["8.8.8.0/24"]})).status_code == 204
        assert (await api.post(f"/sandboxes/{sandbox_id}/connect", json={})).status_code == 201
        assert slot_of(node, sandbox_id) == (True, EgressPolicy.parse(deny=["8.8.8.0/24"]))

        forked = await api.post(f"/sandboxes/{sandbox_id}/fork", json={"count": 1})
        assert forked.status_code == 201, forked.text
        child = forked.json()[0]["sandbox"]["sandboxID"]
        assert slot_of(node, child) == slot_of(node, sandbox_id)
        assert node.row(child).network == node.row(sandbox_id).network
        error(await api.put("/sandboxes/nosuchsandbox0000000/network", json={}), 404)


async def test_an_egress_proxy_reaches_the_slot_and_its_password_is_never_shown(
    tmp_path: Path,
) -> None:
    proxy = {"address": f"{PROXY_IP}:1080", "username": "u", "password": "secret"}
    async with double_node(tmp_path) as node, served(node) as api:
        sandbox_id = await create(api, network={"denyOut": ["8.8.8.8"], "egressProxy": proxy})
        tunnel = SocksProxy(PROXY_IP, 1080, "u", "secret")
        assert slot_of(node, sandbox_id) == (
            True,
            EgressPolicy.parse(deny=["8.8.8.8"], proxy=tunnel),
        )
        info = (await api.get(f"/sandboxes/{sandbox_id}")).json()["network"]
        assert info["egressProxy"] == {"address": f"{PROXY_IP}:1080", "username": "u"}
        assert "secret" not in json.dumps(info)
        url = f"/sandboxes/{sandbox_id}/network"
        assert (await api.put(url, json={"egressProxy": proxy})).status_code == 204
        assert "secret" not in (await api.get(f"/events/sandboxes/{sandbox_id}")).text

        # Paused and resumed: the proxy comes with the sandbox (and with its children).
        assert (await api.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
        assert (await api.post(f"/sandboxes/{sandbox_id}/connect", json={})).status_code == 201
        assert slot_of(node, sandbox_id)[1].proxy == tunnel
        forked = await api.post(f"/sandboxes/{sandbox_id}/fork", json={"count": 1})
        assert slot_of(node, forked.json()[0]["sandbox"]["sandboxID"])[1].proxy == tunnel

        # An update replaces it, one that leaves it out ends the tunneling (E2B's semantics).
        url = f"/sandboxes/{sandbox_id}/network"
        other = {"address": f"{OTHER_IP}:1"}
        assert (await api.put(url, json={"egressProxy": other})).status_code == 204
        assert slot_of(node, sandbox_id)[1].proxy == SocksProxy(OTHER_IP, 1)
        assert (await api.put(url, json={"denyOut": ["8.8.8.8"]})).status_code == 204
        assert slot_of(node, sandbox_id)[1].proxy is None
        info = (await api.get(f"/sandboxes/{sandbox_id}")).json()["network"]
        assert "egressProxy" not in info
        # TLS: its server name shown, its CA certificates not; off is no TLS.
        tls = {"enabled": True, "serverName": "socks.example.com", "caCert": CA_PEM}
        assert (await api.put(url, json={"egressProxy": {**other, "tls": tls}})).status_code == 204
        assert slot_of(node, sandbox_id)[1].proxy == SocksProxy(
            OTHER_IP, 1, tls=True, server_name="socks.example.com", ca_cert=CA_PEM
        )
        info = (await api.get(f"/sandboxes/{sandbox_id}")).json()["network"]
        assert info["egressProxy"] == {
            "address": f"{OTHER_IP}:1",
            "tls": {"enabled": True, "serverName": "socks.example.com"},
        }
        off = {"address": f"{PROXY_IP}:1", "tls": {"enabled": False}}
        assert (await api.put(url, json={"egressProxy": off})).status_code == 204
        assert slot_of(node, sandbox_id)[1].proxy == SocksProxy(PROXY_IP, 1)


async def test_a_slot_that_refuses_the_change_leaves_everything_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        sandbox_id = await create(api, network=RULES)
        before = (node.row(sandbox_id).network, slot_of(node, sandbox_id))
        original = node.slots.set_policy
        calls = 0

        async def refuse_once(slot: Slot, policy: EgressPolicy) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise NftError("refused")
            await original(slot, policy)

        monkeypatch.setattr(node.slots, "set_policy", refuse_once)
        url = f"/sandboxes/{sandbox_id}/network"
        error(await api.put(url, json={"denyOut": ["8.8.8.8"]}), 500)
        assert (node.row(sandbox_id).network, slot_of(node, sandbox_id)) == before


async def test_dns_servers_reach_the_slot_and_an_update_replaces_them(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        sandbox_id = await create(api, network={**RULES, "dnsServers": ["9.9.9.9", "1.1.1.1"]})
        expected = EgressPolicy.parse(
            RULES["allowOut"], RULES["denyOut"], dns_servers=["9.9.9.9", "1.1.1.1"]
        )
        assert slot_of(node, sandbox_id) == (True, expected)
        info = (await api.get(f"/sandboxes/{sandbox_id}")).json()["network"]
        assert info["dnsServers"] == ["9.9.9.9", "1.1.1.1"]
        url = f"/sandboxes/{sandbox_id}/network"
        assert (await api.put(url, json={**RULES, "dnsServers": []})).status_code == 204
        assert slot_of(node, sandbox_id)[1].dns_servers == ()
        assert (await api.put(url, json=RULES)).status_code == 204  # left out: the node's
        assert slot_of(node, sandbox_id)[1].dns_servers is None
        assert "dnsServers" not in (await api.get(f"/sandboxes/{sandbox_id}")).json()["network"]


async def test_https_ports_are_kept_shown_and_inherited(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        sandbox_id = await create(api, network={"httpsPorts": [8443, 3000, 8443]})
        info = (await api.get(f"/sandboxes/{sandbox_id}")).json()["network"]
        assert info["httpsPorts"] == [3000, 8443]
        forked = await api.post(f"/sandboxes/{sandbox_id}/fork", json={"count": 1})
        child = forked.json()[0]["sandbox"]["sandboxID"]
        assert node.row(child).network.https_ports == (3000, 8443)
        plain = await create(api)
        assert "httpsPorts" not in (await api.get(f"/sandboxes/{plain}")).json()["network"]


async def test_private_traffic_gets_a_token_of_its_own(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        private = {"allowPublicTraffic": False, "maskRequestHost": "localhost:${PORT}"}
        created = await api.post("/sandboxes", json={"templateID": "base", "network": private})
        token = created.json()["trafficAccessToken"]
        sandbox_id = created.json()["sandboxID"]
        assert token and node.row(sandbox_id).traffic_access_token == token
        public = await api.post("/sandboxes", json={"templateID": "base"})
        assert public.json()["trafficAccessToken"] is None
        forked = await api.post(f"/sandboxes/{sandbox_id}/fork", json={"count": 1})
        child = forked.json()[0]["sandbox"]
        assert child["trafficAccessToken"] not in (None, token)
        assert node.row(child["sandboxID"]).network.mask_request_host == "localhost:${PORT}"
        assert node.row(sandbox_id).state is SandboxState.RUNNING


@pytest.fixture(params=[False, True], ids=["", "nonlocal bind"])
def host_netns(request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace standing in for the node's host, owning NODE_IP and NODE_RANGE; with
    `ip_nonlocal_bind` set in the second variant (a bind then succeeds for any address)."""
    if os.geteuid() != 0:
        pytest.skip("a host namespace of its own needs root")
    name = f"aenv-test-apihost-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        for args in (
            ("link", "set", "lo", "up"),
            ("addr", "add", f"{NODE_IP}/32", "dev", "lo"),
            ("route", "add", "local", NODE_RANGE, "dev", "lo", "table", "local"),
        ):
            subprocess.run(["ip", "-n", name, *args], check=True)
        nonlocal_bind = f"net.ipv4.ip_nonlocal_bind={int(request.param)}"
        subprocess.run(
            ["ip", "netns", "exec", name, "sysctl", "-q", "-w", nonlocal_bind], check=True
        )
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=True)


async def test_an_egress_proxy_on_the_node_itself_is_refused(
    tmp_path: Path, host_netns: str
) -> None:
    """Tunnels are dialled from the host: one to an address of its own would reach the node's
    services (its API), whatever range the address is in."""
    async with double_node(tmp_path) as node, served(node) as api:
        node.slots.host_netns = host_netns
        sandbox_id = await create(api)
        url = f"/sandboxes/{sandbox_id}/network"
        # A name is judged by the address it resolves to: NODE_IP as one number is a host name
        # to the proxy's syntax, which getaddrinfo resolves without any resolver.
        for address in (NODE_IP, NODE_RANGE_IP, str(int(IPv4Address(NODE_IP)))):
            network = {"egressProxy": {"address": f"{address}:1080"}}
            refused = await api.post("/sandboxes", json={"templateID": "base", "network": network})
            assert "an address of the node itself" in error(refused, 400)
            assert "an address of the node itself" in error(await api.put(url, json=network), 400)
        assert [record.id for record in node.catalog.list()] == [sandbox_id]
        assert slot_of(node, sandbox_id)[1].proxy is None
        # An address the host does not own is still a proxy.
        other = {"egressProxy": {"address": f"{PROXY_IP}:1080"}}
        assert (await api.put(url, json=other)).status_code == 204


@pytest.mark.parametrize(
    ("network", "named"),
    [
        ({"allowOut": ["example.com"]}, "ALL_TRAFFIC"),
        ({"allowOut": ["a..b"], "denyOut": ["0.0.0.0/0"]}, "network.allowOut"),
        ({"denyOut": ["example.com"]}, "network.denyOut"),
        ({"denyOut": ["::/0"]}, "IPv4"),
        # Header rules apply to connections judged by name: everything else must be denied.
        ({"rules": {"a.com": [{"transform": {"headers": {"x": "y"}}}]}}, "judged by name"),
        ({**RULES, "rules": {"1.1.1.1": [{}]}}, "network.rules: '1.1.1.1'"),
        ({**RULES, "rules": {"10.0.0.0/8": [{}]}}, "network.rules: '10.0.0.0/8'"),
        ({**RULES, "rules": {"a..b": [{}]}}, "network.rules: 'a..b'"),
        ({**RULES, "rules": {"a.com": [{"transform": {"headers": {"Host": "b"}}}]}}, "'Host'"),
        ({**RULES, "rules": {"a.com": [{"transform": {"headers": {"a b": "c"}}}]}}, "'a b'"),
        ({**RULES, "rules": {"a.com": [{"transform": {"headers": {"x": "1\r\n"}}}]}}, "'x'"),
        ({**RULES, "rules": {"a.com": [{"transform": {"body": "x"}}]}}, "body"),
        ({**RULES, "rules": {"a.com": [{"match": "x"}]}}, "match"),
        ({"egressProxy": {"address": "p"}}, "network.egressProxy"),
        ({"egressProxy": {"address": "p:65536"}}, "network.egressProxy"),
        ({"egressProxy": {"address": "[::1]:1080"}}, "network.egressProxy"),
        ({"egressProxy": {"address": "p:1", "password": "x"}}, "network.egressProxy"),
        ({"egressProxy": {"address": "p:1", "username": "u" * 256}}, "network.egressProxy"),
        ({"egressProxy": {"address": "p:1", "tls": {"enabled": True, "caCert": "x"}}}, "CA"),
        ({"egressProxy": {"address": "p:1", "tls": {"serverName": "p"}}}, "need tls"),
        ({"egressProxy": {"address": "p:1", "via": "x"}}, "via"),
        # Checked before anything is made, as E2B does: never a proxy slots may not reach.
        ({"egressProxy": {"address": "10.0.0.1:1080"}}, "a range slots may not reach"),
        ({"egressProxy": {"address": "localhost:1080"}}, "a range slots may not reach"),
        ({"egressProxy": {"address": "0.0.0.0:1080"}}, "a range slots may not reach"),
        ({"egressProxy": {"address": "127.0.0.2:1080"}}, "a range slots may not reach"),
        ({"egressProxy": {"address": "10.11.0.1:1080"}}, "a range slots may not reach"),  # slots
        ({"egressProxy": {"address": "[::]:1080"}}, "network.egressProxy"),
        ({"dnsServers": ["1.1.1.1"]}, "dnsServers"),  # without domain rules
        ({**RULES, "dnsServers": ["example.com"]}, "network.dnsServers"),
        ({**RULES, "dnsServers": ["1.1.1.0/24"]}, "network.dnsServers"),
        ({**RULES, "dnsServers": ["1.1.1.1"] * 9}, "network.dnsServers"),
        # Only the node's resolver may be private: a sandbox's own would never be asked.
        ({**RULES, "dnsServers": ["1.1.1.1", "10.0.0.2"]}, "network.dnsServers: 10.0.0.2"),
        ({**RULES, "dnsServers": ["169.254.169.253"]}, "network.dnsServers: 169.254.169.253"),
        ({"httpsPorts": [49983]}, "network.httpsPorts"),
        ({"httpsPorts": [0]}, "network.httpsPorts"),
        ({"maskRequestHost": "a\r\nb"}, "network.maskRequestHost"),
        ({"somethingNew": 1}, "somethingNew"),
    ],
)
async def test_what_cannot_be_honoured_is_refused(
    tmp_path: Path, network: dict[str, object], named: str
) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        refused = await api.post("/sandboxes", json={"templateID": "base", "network": network})
        assert named in error(refused, 400)
        assert node.catalog.list() == []
        if "allowPublicTraffic" not in network and "maskRequestHost" not in network:
            sandbox_id = await create(api)
            updated = await api.put(f"/sandboxes/{sandbox_id}/network", json=network)
            if "httpsPorts" not in network:  # not a field of the update
                assert named in error(updated, 400)
            else:
                assert "httpsPorts" in error(updated, 400)


FILLED = "${e2b.secrets.openai}"  # `Secret.fill("openai")`
RULED = {
    **RULES,
    "rules": {
        "api.example.com": [
            {"transform": {"headers": {"Authorization": "Bearer s3cret", "X-Key": FILLED}}}
        ],
        "*.example.com": [{"transform": {"headers": {"X-Team": "t1", "X-Key": "k2"}}}, {}],
    },
}


async def test_header_rules_reach_the_slot_and_guest_and_are_redacted(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        sandbox_id = await create(api, network=RULED)
        _, policy = slot_of(node, sandbox_id)
        assert policy.headers.headers_for("api.example.com") == (
            ("X-Team", "t1"),
            ("X-Key", "k2"),
            ("Authorization", "Bearer s3cret"),
            ("X-Key", FILLED),
        )
        assert policy.headers.headers_for("example.com") == ()
        # The guest trusts the node's egress CA, named by the usual variables.
        guest = node.guest(sandbox_id)
        assert guest.trusted == [DOUBLE_CA.decode()]
        assert guest.env["SSL_CERT_FILE"] == "/etc/aenv/ca-bundle.pem"
        assert guest.env["NODE_EXTRA_CA_CERTS"] == "/etc/aenv/egress-ca.pem"
        info = (await api.get(f"/sandboxes/{sandbox_id}")).json()["network"]
        assert info["rules"] == {
            # A secret's marker is shown (it names the secret, it is not its value).
            "api.example.com": [
                {"transform": {"headers": {"Authorization": "REDACTED", "X-Key": FILLED}}}
            ],
            "*.example.com": [
                {"transform": {"headers": {"X-Team": "REDACTED", "X-Key": "REDACTED"}}},
                {},
            ],
        }
        assert "s3cret" not in json.dumps(info)

        # Kept across pause and resume, and given to forks; every restore installs the CA
        # again (the node that restores may not be the one that created).
        assert (await api.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
        assert (await api.post(f"/sandboxes/{sandbox_id}/connect", json={})).status_code == 201
        assert slot_of(node, sandbox_id)[1] == policy
        assert node.guest(sandbox_id).trusted == [DOUBLE_CA.decode()] * 2
        forked = await api.post(f"/sandboxes/{sandbox_id}/fork", json={"count": 1})
        child = forked.json()[0]["sandbox"]["sandboxID"]
        assert slot_of(node, child)[1] == policy
        assert node.guest(child).trusted == [DOUBLE_CA.decode()] * 3

        # An update replaces them (omitted: none left); a running guest given rules then
        # trusts the CA at once.
        url = f"/sandboxes/{sandbox_id}/network"
        assert (await api.put(url, json=RULES)).status_code == 204
        assert slot_of(node, sandbox_id)[1].headers.rules == ()
        assert "rules" not in (await api.get(f"/sandboxes/{sandbox_id}")).json()["network"]
        other = await create(api, network=RULES)
        assert node.guest(other).trusted == []
        assert (await api.put(f"/sandboxes/{other}/network", json=RULED)).status_code == 204
        assert node.guest(other).trusted == [DOUBLE_CA.decode()]
        assert slot_of(node, other)[1] == policy
        # Its events (served, and sent to webhooks) show the rules as the info does.
        events = (await api.get(f"/events/sandboxes/{other}")).json()
        assert "REDACTED" in json.dumps(events) and "s3cret" not in json.dumps(events)
        assert FILLED in json.dumps(events)


async def test_header_rules_need_a_node_with_an_egress_ca(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        node.slots.egress_ca = None
        refused = await api.post("/sandboxes", json={"templateID": "base", "network": RULED})
        assert "network.rules" in error(refused, 400)
        sandbox_id = await create(api, network=RULES)
        refused = await api.put(f"/sandboxes/{sandbox_id}/network", json=RULED)
        assert "network.rules" in error(refused, 400)
