"""Domain egress rules with real traffic from a fake guest: HTTP judged by `Host` and TLS by SNI
on any port, wildcards, other protocols by address only, reserved ranges still refused, and
rules changed live."""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from ipaddress import IPv4Address
from typing import cast

import dns.edns
import dns.message
import dns.rcode
import dns.rrset
import dns.update
import pytest
import trustme

from aenv.network import EgressPolicy, Slot, SlotPool, netns
from aenv.network.domains import DomainRules
from aenv.network.sniff import Need, requested_name
from tests.network import probes
from tests.network.conftest import INET_IP, INET_OTHER_IP, INTERNAL_IPS, World
from tests.network.fakeguest import FakeGuest

MakePool = Callable[..., Awaitable[SlotPool]]
Boot = Callable[[Slot], Awaitable[FakeGuest]]
Serve = Callable[[str, str, int, str], Awaitable[None]]

ALLOW = ["allowed.test", "*.wild.test"]
RESOLVER_IP = "198.51.100.53"
# Whatever resolver the guest asks: its queries go to the slot's forwarder.
GUEST_RESOLVER = "192.0.2.53"
DENY_ALL = ["0.0.0.0/0"]
HTTP_PORTS = (80, 8080)
TLS_PORT = 8443


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """An HTTP server that answers with the Host it was asked for."""
    head = await reader.readuntil(b"\r\n\r\n")
    host = next(
        line.split(b":", 1)[1].strip()
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"host:")
    )
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(host), host))
    await writer.drain()
    writer.close()


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
async def web(world: World, ca: trustme.CA) -> AsyncIterator[None]:
    """HTTP on ports 80 and 8080 and HTTPS on 8443 of every internet address."""
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("allowed.test", "*.wild.test", "other.test").configure_cert(server_tls)
    servers = []
    for address in (INET_IP, *INTERNAL_IPS):
        for port, tls in ((80, None), (8080, None), (TLS_PORT, server_tls)):
            sock = await probes.ns_socket(world.inet)
            sock.bind((address, port))
            servers.append(await asyncio.start_server(_answer, sock=sock, ssl=tls))
    yield
    for server in servers:
        server.close()


async def _get(
    guest: FakeGuest, address: str, port: int, host: str, tls: ssl.SSLContext | None = None
) -> str | None:
    """The body the server at address:port answers for `host`, or None if refused."""
    sock = await probes.ns_socket(guest.netns)
    try:
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(loop.sock_connect(sock, (address, port)), 1.0)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(sock=sock, ssl=tls, server_hostname=host if tls else None),
            2.0,
        )
    except (OSError, TimeoutError, ssl.SSLError):
        sock.close()
        return None
    try:
        writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        response = await asyncio.wait_for(reader.read(), 2.0)
    except (OSError, TimeoutError, ssl.SSLError):
        return None
    finally:
        writer.close()
    return response.split(b"\r\n\r\n", 1)[1].decode() if b"\r\n\r\n" in response else None


@pytest.mark.usefixtures("web")
async def test_http_and_tls_are_judged_by_name_on_any_port(
    world: World, pool: SlotPool, boot: Boot, serve: Serve, ca: trustme.CA
) -> None:
    await serve(world.inet, INET_OTHER_IP, 80, "other")
    slot = await pool.acquire(policy=EgressPolicy.parse(allow=ALLOW, deny=DENY_ALL))
    guest = await boot(slot)
    tls = ssl.create_default_context()
    ca.configure_trust(tls)
    for port in HTTP_PORTS:
        assert await _get(guest, INET_IP, port, "allowed.test") == "allowed.test"
        assert await _get(guest, INET_IP, port, "a.b.wild.test") == "a.b.wild.test"
        assert await _get(guest, INET_IP, port, "other.test") is None
        assert await _get(guest, INET_IP, port, "wild.test") is None  # a wildcard is below
    assert await _get(guest, INET_IP, TLS_PORT, "allowed.test", tls) == "allowed.test"
    assert await _get(guest, INET_IP, TLS_PORT, "x.wild.test", tls) == "x.wild.test"
    assert await _get(guest, INET_IP, TLS_PORT, "other.test", tls) is None
    # Other protocols are judged by address alone: a server that speaks first gets nothing.
    assert await probes.probe(guest.netns, INET_OTHER_IP, 80, timeout=0.5) is None
    # Reserved ranges stay closed, whatever name is asked for.
    for address in INTERNAL_IPS:
        assert await _get(guest, address, 80, "allowed.test") is None

    # Addresses allowed alongside names pass untouched; then the names go, and then the deny.
    both = EgressPolicy.parse(allow=[*ALLOW, INET_OTHER_IP], deny=DENY_ALL)
    await pool.set_policy(slot, both)
    assert await probes.probe(guest.netns, INET_OTHER_IP, 80) is not None
    await pool.set_policy(slot, EgressPolicy.parse(deny=DENY_ALL))
    assert await _get(guest, INET_IP, 80, "allowed.test") is None
    await pool.set_policy(slot, EgressPolicy())
    assert await _get(guest, INET_IP, 80, "other.test") == "other.test"


def test_domain_rules_and_names() -> None:
    rules = DomainRules(("Allowed.Test.", "*.wild.test"))
    assert rules.rules == ("*.wild.test", "allowed.test")
    assert [rules.allows(n) for n in ("allowed.test", "ALLOWED.test.", "a.wild.test")] == [True] * 3
    assert [rules.allows(n) for n in ("wild.test", "xallowed.test", "a.allowed.test")] == [
        False
    ] * 3
    for bad in ("*", "a..b", "-a.test", "*.*.test", "a b", "1.2.3.4"):
        with pytest.raises(ValueError):
            DomainRules((bad,))
    policy = EgressPolicy.parse(allow=["1.1.1.1", "*.Example.com"], deny=DENY_ALL)
    assert (policy.domains, [str(n) for n in policy.allow]) == (("*.example.com",), ["1.1.1.1/32"])
    with pytest.raises(ValueError):
        EgressPolicy.parse(deny=["example.com"])
    assert requested_name(b"GET / HTTP/1.1\r\nHost: a.test:8080\r\n\r\n") == "a.test"
    assert requested_name(b"GET / HTTP/1.1\r\nHost: a.te") is Need.MORE
    assert requested_name(b"SSH-2.0-OpenSSH\r\n") is None


class _Resolver(asyncio.DatagramProtocol):
    """The internet's resolver: every name is at `answer` (INET_IP)."""

    def __init__(self, answer: str = INET_IP) -> None:
        self.answer = answer
        self.queries: list[dns.message.Message] = []  # what it was asked, oldest first

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The selector loop's datagram transport does not subclass DatagramTransport.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        query = dns.message.from_wire(data)
        self.queries.append(query)
        response = dns.message.make_response(query)
        name = query.question[0].name
        response.answer.append(dns.rrset.from_text(name, 60, "IN", "A", self.answer))
        self.transport.sendto(response.to_wire(), addr)


async def _resolve(
    guest: FakeGuest, name: str | dns.message.Message
) -> tuple[str, list[str]] | None:
    """Ask GUEST_RESOLVER for `name` (for its A records, or the query given) from the guest:
    the rcode and addresses, or None."""
    query = dns.message.make_query(name, "A") if isinstance(name, str) else name

    def make() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setblocking(False)
        return sock

    sock = await netns.run_in(guest.netns, make)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_sendto(sock, query.to_wire(), (GUEST_RESOLVER, 53))
        data = await asyncio.wait_for(loop.sock_recv(sock, 4096), 2.0)
    except (OSError, TimeoutError):
        return None
    finally:
        sock.close()
    reply = dns.message.from_wire(data)
    addresses = [item.to_text() for rrset in reply.answer for item in rrset]
    return dns.rcode.to_text(reply.rcode()), addresses


async def test_dns_answers_only_allowed_names(
    world: World, make_pool: MakePool, boot: Boot
) -> None:
    sock = await netns.run_in(world.inet, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    _add_address(world.inet, RESOLVER_IP)
    sock.bind((RESOLVER_IP, 53))
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(_Resolver, sock=sock)
    try:
        pool = await make_pool(dns_upstream=IPv4Address(RESOLVER_IP))
        policy = EgressPolicy.parse(allow=ALLOW, deny=DENY_ALL)
        guest = await boot(await pool.acquire(policy=policy))
        assert await _resolve(guest, "allowed.test") == ("NOERROR", [INET_IP])
        assert await _resolve(guest, "deep.x.wild.test") == ("NOERROR", [INET_IP])
        assert await _resolve(guest, "other.test") == ("NXDOMAIN", [])
        # Without domain rules, queries go where the guest sends them (nowhere, here).
        await pool.set_policy(guest.slot, EgressPolicy())
        assert await _resolve(guest, "other.test") is None
    finally:
        transport.close()


@pytest.mark.usefixtures("web")
@pytest.mark.parametrize(
    ("on_host", "resolver"),
    [(False, "10.250.0.53"), (False, "169.254.169.253"), (True, "127.0.0.53")],
)
async def test_the_node_resolver_may_be_private_link_local_or_the_hosts_own(
    world: World, make_pool: MakePool, boot: Boot, serve: Serve, on_host: bool, resolver: str
) -> None:
    """A cloud host's resolver (a VPC's in 10/8, AWS's at 169.254.169.253), or a stub on the
    host's loopback (systemd's 127.0.0.53), is where no slot may go, yet it is the node's: it
    is asked from the host, and the guest gets its allowed names and reaches them. It still
    reaches nothing else there: what the resolver is sent is the guest's question alone, and
    no other kind of message."""
    where = world.host if on_host else world.inet
    sock = await netns.run_in(where, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    if not on_host:
        _add_address(where, resolver)
    sock.bind((resolver, 53))
    loop = asyncio.get_running_loop()
    transport, server = await loop.create_datagram_endpoint(_Resolver, sock=sock)
    await serve(where, resolver, 53, "resolver")  # DNS over TCP
    try:
        pool = await make_pool(dns_upstream=IPv4Address(resolver))
        guest = await boot(await pool.acquire(policy=EgressPolicy.parse(ALLOW, DENY_ALL)))
        assert await _resolve(guest, "allowed.test") == ("NOERROR", [INET_IP])
        assert await _resolve(guest, "other.test") == ("NXDOMAIN", [])
        assert await _get(guest, INET_IP, 80, "allowed.test") == "allowed.test"
        assert await probes.probe(guest.netns, resolver, 53, timeout=0.5) is None

        extra = dns.message.make_query("allowed.test", "TXT", use_edns=0, payload=1400)
        extra.use_edns(0, payload=1400, options=[dns.edns.ECSOption("192.0.2.0", 24)])
        extra.additional.append(dns.rrset.from_text("a.test.", 60, "IN", "TXT", '"guest"'))
        assert await _resolve(guest, extra) == ("NOERROR", [INET_IP])
        forwarded = server.queries[-1]
        assert (forwarded.id, forwarded.question) == (extra.id, extra.question)
        assert (forwarded.payload, list(forwarded.options), forwarded.additional) == (1400, [], [])
        update = dns.update.UpdateMessage("allowed.test")
        update.add("x.allowed.test.", 60, "A", INET_IP)
        asked = len(server.queries)
        assert await _resolve(guest, update) == ("NOTIMP", [])
        assert len(server.queries) == asked
    finally:
        transport.close()


async def test_a_sandbox_names_its_own_resolvers(
    world: World, make_pool: MakePool, boot: Boot
) -> None:
    """`dnsServers`: asked in order instead of the node's, never one in a reserved range (its
    answer would show), none at all answers REFUSED."""
    own, reserved = INET_OTHER_IP, INTERNAL_IPS[1]
    transports = []
    for address, answer in ((RESOLVER_IP, INET_IP), (own, "203.0.113.77"), (reserved, "6.6.6.6")):
        sock = await netns.run_in(
            world.inet, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        )
        if address == RESOLVER_IP:  # the others are on the internet's loopback already
            _add_address(world.inet, address)
        sock.bind((address, 53))
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            partial(_Resolver, answer), sock=sock
        )
        transports.append(transport)
    try:
        pool = await make_pool(dns_upstream=IPv4Address(RESOLVER_IP))
        policy = EgressPolicy.parse(allow=ALLOW, deny=DENY_ALL, dns_servers=[reserved, own])
        guest = await boot(await pool.acquire(policy=policy))
        assert await _resolve(guest, "allowed.test") == ("NOERROR", ["203.0.113.77"])
        assert await _resolve(guest, "other.test") == ("NXDOMAIN", [])
        # A resolver that does not answer: the next one is asked.
        silent = "192.0.2.99"
        await pool.set_policy(
            guest.slot, EgressPolicy.parse(ALLOW, DENY_ALL, dns_servers=[silent, own])
        )
        assert await _resolve(guest, "allowed.test") == ("NOERROR", ["203.0.113.77"])
        await pool.set_policy(guest.slot, EgressPolicy.parse(ALLOW, DENY_ALL, dns_servers=[]))
        assert await _resolve(guest, "allowed.test") == ("REFUSED", [])
        await pool.set_policy(guest.slot, EgressPolicy.parse(allow=ALLOW, deny=DENY_ALL))
        assert await _resolve(guest, "allowed.test") == ("NOERROR", [INET_IP])
    finally:
        for transport in transports:
            transport.close()


def _add_address(ns: str, address: str) -> None:
    subprocess.run(["ip", "-n", ns, "addr", "add", f"{address}/32", "dev", "lo"], check=True)
