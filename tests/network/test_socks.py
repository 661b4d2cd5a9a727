"""A sandbox's own SOCKS5 proxy (`egressProxy`) with real traffic from a fake guest, through a
real SOCKS5 server (microsocks) in the "internet" namespace: what the address lists allow goes
through it (a server that speaks first included), what they deny does not, names allowed by a
domain rule reach the proxy as names (it resolves them), reserved ranges stay closed, a proxy
that refuses the credentials or sits in a reserved range fails the connection rather than
letting it out directly, TLS to the proxy (verified, never plaintext instead), and the proxy is
set and removed live (its tunnels end with it)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial

import pytest
import trustme

from aenv.network import EgressPolicy, Slot, SlotPool
from aenv.network.socks import SocksProxy
from tests.network import probes
from tests.network.conftest import HOST_UPLINK_IP, INET_IP, INET_OTHER_IP, INTERNAL_IPS, World
from tests.network.fakeguest import FakeGuest
from tests.support.socks_server import PASSWORD, PORT, USER, socks_server

Boot = Callable[[Slot], Awaitable[FakeGuest]]
Serve = Callable[[str, str, int, str], Awaitable[None]]

# The proxy's own address in the internet namespace; its outgoing connections leave from it,
# so a server's greeting tells a tunneled connection from a direct one (HOST_UPLINK_IP).
SOCKS_IP = "198.51.100.80"
PROXY = SocksProxy(SOCKS_IP, PORT, USER, PASSWORD)
GREETING_PORT = 7000


@pytest.fixture
def socks(world: World) -> Iterator[None]:
    """microsocks on SOCKS_IP, on one of the reserved addresses and on the host's own uplink
    address; `allowed.test` is INET_OTHER_IP to it (not where the guest dialled)."""
    subprocess.run(
        ["ip", "-n", world.inet, "addr", "add", f"{SOCKS_IP}/32", "dev", "lo"], check=True
    )
    names = {"allowed.test": INET_OTHER_IP}
    with (
        socks_server(world.inet, SOCKS_IP, SOCKS_IP, names),
        socks_server(world.inet, INTERNAL_IPS[1], SOCKS_IP, names),
        socks_server(world.host, HOST_UPLINK_IP, HOST_UPLINK_IP, names),
    ):
        yield


@pytest.fixture
async def greeters(world: World, serve: Serve) -> AsyncIterator[None]:
    """Greeting servers (they speak first) on INET_IP and INET_OTHER_IP."""
    await serve(world.inet, INET_IP, GREETING_PORT, "one")
    await serve(world.inet, INET_OTHER_IP, GREETING_PORT, "other")
    yield


async def _http_from(guest: FakeGuest, address: str, host: str) -> str | None:
    """The first line a plain HTTP GET for `host` to `address` gets back (None: refused)."""
    conn = await _open(guest, address)
    if conn is None:
        return None
    reader, writer = conn
    try:
        writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        return (await asyncio.wait_for(reader.readline(), 5)).decode().strip() or None
    except (OSError, TimeoutError):
        return None
    finally:
        writer.close()


async def _open(
    guest: FakeGuest, address: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    sock = await probes.ns_socket(guest.netns)
    try:
        await asyncio.wait_for(
            asyncio.get_running_loop().sock_connect(sock, (address, GREETING_PORT)), 5
        )
    except (OSError, TimeoutError):
        sock.close()
        return None
    return await asyncio.open_connection(sock=sock)


@pytest.mark.usefixtures("socks", "greeters")
async def test_allowed_tcp_goes_through_the_proxy_and_denied_does_not(
    pool: SlotPool, boot: Boot
) -> None:
    policy = EgressPolicy.parse(deny=[f"{INET_OTHER_IP}/32"], proxy=PROXY)
    guest = await boot(await pool.acquire(policy=policy))
    # The server speaks first: the tunnel does not wait for the guest's first bytes.
    assert await probes.probe(guest.netns, INET_IP, GREETING_PORT) == f"one {SOCKS_IP}"
    conn = await probes.connect(guest.netns, INET_IP, GREETING_PORT)
    assert conn is not None and await probes.echo(conn)
    conn[1].close()
    assert await probes.probe(guest.netns, INET_OTHER_IP, GREETING_PORT, timeout=1) is None
    for address in INTERNAL_IPS:
        assert await probes.probe(guest.netns, address, GREETING_PORT, timeout=1) is None
    # What nft refuses never reaches the slot's proxy; what it sends there is counted.
    counts = pool.egress_counts
    assert (counts.tunneled, counts.relayed, counts.refused, counts.failed) == (2, 0, 0, 0)


@pytest.mark.usefixtures("socks", "greeters")
async def test_a_name_allowed_by_a_domain_rule_is_resolved_by_the_proxy(
    pool: SlotPool, boot: Boot
) -> None:
    policy = EgressPolicy.parse(allow=["allowed.test"], deny=["0.0.0.0/0"], proxy=PROXY)
    guest = await boot(await pool.acquire(policy=policy))
    # Dialled INET_IP, asked for allowed.test: the proxy resolved the name to INET_OTHER_IP,
    # whose server answered (greeting first, then the request's echo).
    assert await _http_from(guest, INET_IP, "allowed.test") == f"other {SOCKS_IP}"
    assert await _http_from(guest, INET_IP, "denied.test") is None
    assert (pool.egress_counts.tunneled, pool.egress_counts.refused) == (1, 1)


@pytest.mark.usefixtures("socks", "greeters")
async def test_a_proxy_that_refuses_or_is_internal_fails_closed(pool: SlotPool, boot: Boot) -> None:
    for proxy in (
        SocksProxy(SOCKS_IP, PORT, USER, "wrong"),
        SocksProxy(SOCKS_IP, PORT),  # no credentials, which it asks for
        SocksProxy(SOCKS_IP, PORT + 1, USER, PASSWORD),  # nothing listens
        SocksProxy(INTERNAL_IPS[1], PORT, USER, PASSWORD),  # a private range
        # The host's own address, public: a proxy there would be a service of the node.
        SocksProxy(HOST_UPLINK_IP, PORT, USER, PASSWORD),
    ):
        guest = await boot(await pool.acquire(policy=EgressPolicy(proxy=proxy)))
        assert await probes.probe(guest.netns, INET_IP, GREETING_PORT, timeout=2) is None, proxy
    assert (pool.egress_counts.failed, pool.egress_counts.tunneled) == (5, 0)


@pytest.mark.usefixtures("socks", "greeters")
async def test_the_proxy_is_set_and_removed_live(pool: SlotPool, boot: Boot) -> None:
    slot = await pool.acquire()
    guest = await boot(slot)
    direct = await probes.connect(guest.netns, INET_IP, GREETING_PORT)
    assert direct is not None and direct[2] == f"one {HOST_UPLINK_IP}"
    await pool.set_policy(slot, EgressPolicy(proxy=PROXY))
    assert await probes.probe(guest.netns, INET_IP, GREETING_PORT) == f"one {SOCKS_IP}"
    tunneled = await probes.connect(guest.netns, INET_IP, GREETING_PORT)
    assert tunneled is not None
    await pool.set_policy(slot, EgressPolicy())
    assert await probes.probe(guest.netns, INET_IP, GREETING_PORT) == f"one {HOST_UPLINK_IP}"
    # A direct connection keeps going; a tunnel ends with the slot's proxy.
    assert await probes.echo(direct)
    assert not await probes.echo(tunneled)
    for conn in (direct, tunneled):
        conn[1].close()


TLS_PORT = 1443


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()


@pytest.fixture
async def tls_front(world: World) -> AsyncIterator[trustme.CA]:
    """TLS on SOCKS_IP:TLS_PORT in front of the plaintext SOCKS server, with a certificate for
    `socks.test` from the CA it yields."""
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("socks.test").configure_cert(context)

    async def front(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = await probes.ns_socket(world.inet)
        await asyncio.get_running_loop().sock_connect(sock, (SOCKS_IP, PORT))
        up_reader, up_writer = await asyncio.open_connection(sock=sock)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    sock = await probes.ns_socket(world.inet)
    sock.bind((SOCKS_IP, TLS_PORT))
    server = await asyncio.start_server(front, sock=sock, ssl=context)
    yield ca
    server.close()


@pytest.mark.usefixtures("socks", "greeters")
async def test_tls_to_the_proxy_is_verified_and_never_falls_back(
    pool: SlotPool, boot: Boot, tls_front: trustme.CA
) -> None:
    ca_cert = tls_front.cert_pem.bytes().decode()
    stranger = trustme.CA().cert_pem.bytes().decode()
    over_tls = partial(SocksProxy, SOCKS_IP, username=USER, password=PASSWORD, tls=True)

    async def probe(proxy: SocksProxy) -> str | None:
        guest = await boot(await pool.acquire(policy=EgressPolicy(proxy=proxy)))
        return await probes.probe(guest.netns, INET_IP, GREETING_PORT, timeout=2)

    assert await probe(over_tls(TLS_PORT, server_name="socks.test", ca_cert=ca_cert)) == (
        f"one {SOCKS_IP}"
    )
    for proxy in (
        over_tls(TLS_PORT, server_name="socks.test", ca_cert=stranger),
        over_tls(TLS_PORT, ca_cert=ca_cert),  # the certificate names socks.test, not the address
        over_tls(PORT, server_name="socks.test", ca_cert=ca_cert),  # a plaintext proxy
        SocksProxy(SOCKS_IP, TLS_PORT, USER, PASSWORD),  # plaintext to the TLS port
    ):
        assert await probe(proxy) is None, proxy
