"""A sandbox's own SOCKS5 proxy (E2B's `network.egressProxy`, "bring your own proxy"): the
upstream its slot's egress proxy tunnels the guest's TCP connections through.

The tunnel is opened from the host (the network config's host namespace), after the slot's
allow/deny judgement, so nothing runs in the guest and the guest can neither see the proxy nor
route around it. It fails closed: a proxy that cannot be reached, refuses the credentials or
the destination, or does not speak SOCKS5 fails the guest's connection; nothing falls back to a
direct one. The proxy's host name is resolved at each dial and the address pinned for that
connection; an address in the node's denied ranges (private, link-local, the slots' own
network: `reserved`) is refused, as E2B refuses internal proxies, unless the operator opened
that range to slots. So is an address the host itself owns, whatever its range (a public
address of an interface, a local route): the tunnel is dialled from the host namespace, where
such a connection would reach the node's own services (its API, an SSH server). The host's
addresses are looked up at each dial, as they change with its interfaces.

A destination the guest reached by name (a domain `allowOut` rule) is passed on as that name
(RFC 1928 ATYP domain), so the proxy resolves it; one allowed by address, as the address.
Credentials follow RFC 1929. With `tls`, the hop to the proxy runs in TLS (1.2 or newer, the
certificate always verified against the system's trust store or the sandbox's own CA
certificates, for `server_name` or the address's host), and the handshake, credentials and
tunneled bytes inside it; a failure never falls back to plaintext. The protocol is socksio's
(sans-I/O) over our own streams: the socket has to be made in the host namespace, which proxy
client libraries do not allow for.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import re
import socket
import ssl
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, ip_address
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl import rtypes
from socksio import ProtocolError, socks5

from aenv.network import netns

_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*\.?")
_MAX_CREDENTIAL = 255  # bytes, RFC 1929
_MAX_CA_CERT = 8192  # bytes, as E2B takes
# A SOCKS5 command reply: version, code, reserved, address type, then the bound address.
_ADDRESS_LENGTH = {b"\x01": 4, b"\x04": 16}


class TunnelError(OSError):
    """The proxy could not be reached or refused the tunnel."""


@dataclass(frozen=True)
class SocksProxy:
    """Where a sandbox's TCP egress is tunneled. Raises ValueError for an address that is not
    `host:port` (an IPv4 address or a host name), for credentials RFC 1929 cannot carry, and
    for TLS settings without `tls` or that do not load (`ca_cert` is PEM)."""

    host: str
    port: int
    username: str | None = None
    password: str | None = None
    tls: bool = False
    server_name: str | None = None
    ca_cert: str | None = None

    def __post_init__(self) -> None:
        if (self.server_name is not None or self.ca_cert is not None) and not self.tls:
            raise ValueError("server_name and ca_cert need tls")
        if self.server_name is not None and not _HOST.fullmatch(self.server_name):
            raise ValueError(f"server name {self.server_name!r} is not a host name")
        if self.ca_cert is not None:
            if len(self.ca_cert.encode()) > _MAX_CA_CERT:
                raise ValueError(f"the CA certificates exceed {_MAX_CA_CERT} bytes")
            _trusting(self.ca_cert)
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")
        if not _is_ipv4(self.host) and not _HOST.fullmatch(self.host):
            raise ValueError(f"{self.host!r} is not an IPv4 address or a host name")
        if self.password is not None and self.username is None:
            raise ValueError("a password needs a username")
        for name, value in (("username", self.username), ("password", self.password)):
            if value is not None and not 0 < len(value.encode()) <= _MAX_CREDENTIAL:
                raise ValueError(f"{name} must be 1 to {_MAX_CREDENTIAL} bytes")

    @classmethod
    def parse(cls, address: str, **options: Any) -> SocksProxy:
        """From `host:port` and the other fields by name."""
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"{address!r} is not host:port")
        return cls(host, int(port), **options)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @functools.cached_property
    def tls_context(self) -> ssl.SSLContext:
        """How the hop to the proxy is verified: the system's trust store, or `ca_cert` alone.
        Made once per proxy, at its first tunnel: loading the system's store costs ≈ 18 ms of
        CPU, which neither every connection nor every read of a sandbox's settings should pay."""
        ca_cert = self.ca_cert
        context = ssl.create_default_context() if ca_cert is None else _trusting(ca_cert)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context

    def to_json(self) -> dict[str, Any]:
        fields = ("username", "password", "tls", "server_name", "ca_cert")
        return {"address": self.address, **{name: getattr(self, name) for name in fields}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SocksProxy:
        return cls.parse(**data)


def _trusting(ca_cert: str) -> ssl.SSLContext:
    """A client context that trusts `ca_cert` (PEM) alone; ValueError if it does not load."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cadata=ca_cert)
    except (ssl.SSLError, ValueError) as e:
        raise ValueError(f"the CA certificates do not load: {e}") from e
    return context


def _is_ipv4(host: str) -> bool:
    try:
        return isinstance(ip_address(host), IPv4Address)
    except ValueError:
        return False


def _outgoing() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    return sock


def _delivered_locally(address: IPv4Address) -> bool:
    """Whether the calling thread's namespace keeps a connection to `address` to itself: every
    address of every interface and every local route, as they are now. The kernel binds a
    socket only to such an address, so a refused bind answers at once (≈ 10 µs, where opening
    a netlink socket costs ≈ 2 ms of CPU); a bind that succeeds, also possible where
    `ip_nonlocal_bind` is set, is settled by the route lookup."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((str(address), 0))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                return False
    with IPRoute() as ipr:
        try:
            routes = ipr.route("get", dst=str(address))
        except NetlinkError:  # no route at all: nothing local either
            return False
    return any(route["type"] == rtypes["RTN_LOCAL"] for route in routes)


async def resolve(
    proxy: SocksProxy, denied: tuple[IPv4Network, ...], host_netns: str | None
) -> IPv4Address:
    """The address to dial `proxy` at, now; `TunnelError` when its name does not resolve, the
    address is in `denied` or is one of the host's own (in `host_netns`, where tunnels are
    dialled from)."""
    loop = asyncio.get_running_loop()
    try:
        found = await loop.getaddrinfo(
            proxy.host, proxy.port, family=socket.AF_INET, type=socket.SOCK_STREAM
        )
    except OSError as e:
        raise TunnelError(f"proxy {proxy.host} does not resolve: {e}") from e
    address = IPv4Address(found[0][4][0])
    if any(address in network for network in denied):
        raise TunnelError(f"proxy {proxy.host} is at {address}, a range slots may not reach")
    if await netns.run_in(host_netns, functools.partial(_delivered_locally, address)):
        raise TunnelError(f"proxy {proxy.host} is at {address}, an address of the node itself")
    return address


async def open_tunnel(
    proxy: SocksProxy,
    destination: str,
    port: int,
    *,
    denied: tuple[IPv4Network, ...],
    host_netns: str | None,
    timeout: float,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream to `destination` (an IPv4 address or a name) and `port` through `proxy`,
    connected and past the SOCKS5 handshake. `TunnelError` when any step fails."""
    address = await resolve(proxy, denied, host_netns)
    sock = await netns.run_in(host_netns, _outgoing)
    loop = asyncio.get_running_loop()
    with contextlib.ExitStack() as undo:
        undo.callback(sock.close)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (str(address), proxy.port)), timeout)
        except (OSError, TimeoutError) as e:
            raise TunnelError(f"proxy {proxy.address} cannot be reached: {e}") from e
        try:
            reader, writer = await asyncio.open_connection(
                sock=sock,
                ssl=proxy.tls_context if proxy.tls else None,
                server_hostname=(proxy.server_name or proxy.host) if proxy.tls else None,
                ssl_handshake_timeout=timeout if proxy.tls else None,
            )
        except OSError as e:  # ssl.SSLError included: never plaintext instead
            raise TunnelError(f"TLS to proxy {proxy.address} failed: {e}") from e
        undo.pop_all()  # the stream owns the socket now: closing it closes both
        undo.callback(writer.close)
        try:
            await asyncio.wait_for(_handshake(proxy, destination, port, reader, writer), timeout)
        except (OSError, TimeoutError, ProtocolError, ValueError, asyncio.IncompleteReadError) as e:
            raise TunnelError(f"proxy {proxy.address} refused {destination}:{port}: {e}") from e
        undo.pop_all()
    return reader, writer


async def _handshake(
    proxy: SocksProxy,
    destination: str,
    port: int,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> None:
    connection = socks5.SOCKS5Connection()

    async def exchange(request: Any, reply_size: int | None = None) -> Any:
        connection.send(request)
        writer.write(connection.data_to_send())
        await writer.drain()
        if reply_size is not None:
            return connection.receive_data(await reader.readexactly(reply_size))
        head = await reader.readexactly(4)
        if head[3:4] == b"\x03":  # a bound address given as a name: its length comes first
            length = await reader.readexactly(1)
            rest = length + await reader.readexactly(length[0] + 2)
        else:
            rest = await reader.readexactly(_ADDRESS_LENGTH.get(head[3:4], 4) + 2)
        return connection.receive_data(head + rest)

    methods = [socks5.SOCKS5AuthMethod.NO_AUTH_REQUIRED]
    if proxy.username is not None:
        methods.insert(0, socks5.SOCKS5AuthMethod.USERNAME_PASSWORD)
    chosen = await exchange(socks5.SOCKS5AuthMethodsRequest(methods), 2)
    if chosen.method not in methods:
        raise TunnelError(f"no acceptable authentication method ({chosen.method.name})")
    if chosen.method is socks5.SOCKS5AuthMethod.USERNAME_PASSWORD:
        assert proxy.username is not None
        credentials = socks5.SOCKS5UsernamePasswordRequest(
            proxy.username.encode(), (proxy.password or "").encode()
        )
        if not (await exchange(credentials, 2)).success:
            raise TunnelError("the credentials were refused")
    command = socks5.SOCKS5CommandRequest.from_address(
        socks5.SOCKS5Command.CONNECT, (destination, port)
    )
    reply = await exchange(command)
    if reply.reply_code is not socks5.SOCKS5ReplyCode.SUCCEEDED:
        raise TunnelError(f"the proxy answered {reply.reply_code.name}")
