"""A slot's egress proxy: its TCP connections judged by the name they ask for (domain rules),
and tunneled through the sandbox's own SOCKS5 proxy when it has one.

How it works, per slot whose policy names domains (E2B's `allowOut: ["example.com"]`):

1. The slot table redirects every new TCP connection of the guest whose destination the
   address lists do not allow (`allow` wins as usual) to this proxy's port on the guest's
   gateway address, inside the slot namespace (`rules`, set `sniffed`). The guest notices
   nothing: the connection seems to reach the address it dialled.
2. The proxy (a listening socket made in the slot namespace, served by the server's event loop)
   reads the first bytes and takes the name from the TLS ClientHello's SNI or the HTTP `Host`
   header (`sniff`), whatever the port. Any other protocol, or a name no rule allows, gets the
   connection closed.
3. For an allowed name it connects to the original destination (`SO_ORIGINAL_DST`) from the
   slot namespace, so the connection leaves like the guest's own would (masqueraded to the slot
   address, then the host's), replays the bytes it read and relays both ways. Reserved ranges
   stay refused here too, since these connections do not cross the slot's forward chain.
4. DNS queries go to the slot's `dns.DnsForwarder`, started and stopped with the proxy, which
   answers only for allowed names, from the node's resolver (asked from the host namespace)
   or the sandbox's own.

For a name with header rules (E2B's `network.rules`, `header_rules`), step 3 goes further: the
proxy opens a TLS connection to the destination that must verify for that name, meanwhile
answers the guest's handshake with a certificate of the node's egress CA, and once both are up
relays the guest's HTTP/1.1 or HTTP/2 requests as HTTP/1.1 with the rules' headers set
(`interception`, `interception_h2`), the secrets and workload identity tokens they name read
or minted as each request is sent (`identity`). A
rule applies only to names the policy allows, and only over TLS: a plain-HTTP connection to
such a name is refused, since its destination is whatever address the guest dialled and
nothing checks it is the named server.

With a SOCKS5 proxy (E2B's `egressProxy`, `socks`), the slot table also redirects the new TCP
connections the address lists let through (set `proxied`). Those are tunneled at once, without
waiting for a first byte (SSH and SMTP servers speak first), to the address the guest dialled;
a connection allowed by name is tunneled to that name, which the SOCKS proxy resolves. The
tunnel starts from the host, not the slot; nothing goes out directly while a proxy is set.

The name is what the client claims, as in E2B: a client that resolves a name itself and sends
it to another address reaches that address. Addresses are still judged: the reserved ranges
are never reachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import struct
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network

import h2.exceptions
import h11

from aenv.network import netns
from aenv.network.dns import DnsForwarder
from aenv.network.domains import DomainRules
from aenv.network.egress_ca import EgressCA
from aenv.network.header_rules import Headers, SecretValues, TokenSource, resolve
from aenv.network.identity import Signer, WorkloadIdentity
from aenv.network.interception import GuestTls, PlainStream, Stream, exchange
from aenv.network.interception_h2 import Bridge
from aenv.network.policy import EgressPolicy
from aenv.network.slot import Slot
from aenv.network.sniff import Need, requested_name, tls_alpn
from aenv.network.socks import open_tunnel

log = logging.getLogger(__name__)

PROXY_PORT = 15001
_SO_ORIGINAL_DST = 80
_TLS_HANDSHAKE = 0x16
# A ClientHello or request head larger than this names nothing we will accept.
_MAX_HEAD = 16 * 1024
_HEAD_TIMEOUT_S = 10.0
_CONNECT_TIMEOUT_S = 10.0
_CHUNK = 256 * 1024


def original_destination(sock: socket.socket) -> tuple[IPv4Address, int]:
    raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    port, address = struct.unpack_from("!2xH4s", raw)
    return IPv4Address(address), port


def _listener(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, PROXY_PORT))
    sock.listen(512)
    sock.setblocking(False)
    return sock


def _outgoing() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    return sock


async def _head(reader: asyncio.StreamReader) -> tuple[bytes, str | None]:
    data = b""
    while len(data) < _MAX_HEAD:
        chunk = await reader.read(_MAX_HEAD - len(data))
        if not chunk:
            return data, None
        data += chunk
        name = requested_name(data)
        if name is not Need.MORE:
            return data, name
    return data, None


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(_CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()


def _no_delay(writer: asyncio.StreamWriter) -> None:
    """Small writes go out at once. asyncio does this only for sockets it made as TCP (these
    are made with protocol 0); the interception writes HTTP/2 frames and TLS records one by
    one, which Nagle's algorithm would hold for the guest's delayed ACK (40 ms a response)."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


@dataclass
class EgressCounts:
    """What the node's slot proxies did with the connections sent to them, since it started:
    `relayed` directly, `tunneled` through a sandbox's SOCKS5 proxy, `refused` (a name no rule
    allows, a reserved range) and `failed` (the destination or the SOCKS5 proxy did not take
    it: a guest fails closed there, so an operator looks here first). `intercepted` counts
    the relayed or tunneled ones whose requests got header rules."""

    relayed: int = 0
    tunneled: int = 0
    refused: int = 0
    failed: int = 0
    intercepted: int = 0


@dataclass(frozen=True)
class Interception:
    """What a proxy needs to apply header rules: the node's CA, how servers are checked
    (`upstream`, offering HTTP/1.1; `upstream_h2`, offering HTTP/2 too, for guests that offer
    it; None: `upstream` for all), where the secrets rules name are read and who signs the
    tokens they name (None: a rule naming one sends nothing)."""

    ca: EgressCA
    upstream: ssl.SSLContext
    secrets: SecretValues | None = None
    signer: Signer | None = None
    upstream_h2: ssl.SSLContext | None = None

    def tokens(self, identity: WorkloadIdentity | None) -> TokenSource:
        """The tokens of `identity` (none without one, or without a signer)."""

        def token(name: str) -> str | None:
            audience = None if identity is None else identity.tokens.audience(name)
            if audience is None or identity is None or self.signer is None:
                return None
            return self.signer.token(identity.subject, audience)

        return token


class EgressProxy:
    """The proxy of one slot. `policy` may be replaced at any time; connections already relayed
    keep going (E2B judges a connection when it starts)."""

    def __init__(
        self,
        slot: Slot,
        policy: EgressPolicy,
        denied: tuple[IPv4Network, ...],
        dns_upstream: IPv4Address,
        host_netns: str | None,
        counts: EgressCounts,
        interception: Interception | None = None,
    ) -> None:
        self.slot = slot
        self._interception = interception
        self._counts = counts
        self._policy = policy
        self._rules = DomainRules(policy.domains)
        self._denied = denied
        self._host_netns = host_netns
        self._dns = DnsForwarder(
            slot, self._rules, policy.dns_servers, dns_upstream, host_netns, denied
        )
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def policy(self) -> EgressPolicy:
        return self._policy

    @policy.setter
    def policy(self, policy: EgressPolicy) -> None:
        self._policy = policy
        self._rules = self._dns.rules = DomainRules(policy.domains)
        self._dns.own = policy.dns_servers

    async def start(self) -> None:
        gateway = str(self.slot.guest.gateway)
        sock = await netns.run_in(self.slot.netns, lambda: _listener(gateway))
        async with contextlib.AsyncExitStack() as undo:
            self._server = await asyncio.start_server(self._accepted, sock=sock)
            undo.push_async_callback(self.close)
            await self._dns.start()
            undo.pop_all()

    async def close(self) -> None:
        await self._dns.close()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._serve(reader, writer)
        except (OSError, TimeoutError) as e:
            # Debug, not info: a guest decides how often this happens.
            log.debug("slot %s: connection ended: %s", self.slot.netns, e)
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        address, port = original_destination(writer.get_extra_info("socket"))
        policy, rules = self._policy, self._rules
        if any(address in network for network in self._denied):
            log.debug("slot %s: refused %s:%d (reserved)", self.slot.netns, address, port)
            self._counts.refused += 1
            return
        head, name = b"", None
        # Allowed by address: sent here to be tunneled (or by the rule of a proxy an update
        # has just removed: then it goes out directly, as the policy now says).
        if not policy.admits(address):
            head, name = await asyncio.wait_for(_head(reader), _HEAD_TIMEOUT_S)
            if name is None or not rules.allows(name):
                log.debug("slot %s: refused %s (%s:%d)", self.slot.netns, name, address, port)
                self._counts.refused += 1
                return
        rule_headers = policy.headers.headers_for(name) if name is not None else ()
        if rule_headers and (head[:1] != bytes([_TLS_HANDSHAKE]) or self._interception is None):
            # Never out without its headers, nor its headers to an unchecked destination.
            log.debug("slot %s: refused %s:%d (rules, not TLS)", self.slot.netns, name, port)
            self._counts.refused += 1
            return
        if rule_headers:
            assert name is not None
            destination = (policy, address, port)
            await self._intercept(reader, writer, head, name, rule_headers, destination)
            return
        up_reader, up_writer = await self._upstream(policy, name, address, port)
        try:
            up_writer.write(head)
            await asyncio.gather(_relay(reader, up_writer), _relay(up_reader, writer))
        finally:
            up_writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await up_writer.wait_closed()

    async def _upstream(
        self, policy: EgressPolicy, name: str | None, address: IPv4Address, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            if policy.proxy is not None:
                streams = await open_tunnel(
                    policy.proxy,
                    name or str(address),
                    port,
                    denied=self._denied,
                    host_netns=self._host_netns,
                    timeout=_CONNECT_TIMEOUT_S,
                )
                self._counts.tunneled += 1
            else:
                streams = await self._direct(address, port)
                self._counts.relayed += 1
        except (OSError, TimeoutError):
            self._counts.failed += 1
            raise
        return streams

    async def _verified(
        self, policy: EgressPolicy, name: str, address: IPv4Address, port: int, http2: bool
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to the destination whose TLS verified for `name`, offering HTTP/2 if
        `http2`. Raises OSError, TimeoutError or ssl.SSLError (counted as failed)."""
        interception = self._interception
        assert interception is not None
        context = interception.upstream
        if http2 and interception.upstream_h2 is not None:
            context = interception.upstream_h2
        up_reader, up_writer = await self._upstream(policy, name, address, port)
        _no_delay(up_writer)
        try:
            await asyncio.wait_for(
                up_writer.start_tls(context, server_hostname=name), _CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError, ssl.SSLError):
            self._counts.failed += 1
            up_writer.close()
            raise
        return up_reader, up_writer

    async def _intercept(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        head: bytes,
        name: str,
        headers: tuple[tuple[str, str], ...],
        destination: tuple[EgressPolicy, IPv4Address, int],
    ) -> None:
        """Apply `name`'s header rules to the guest's requests (`interception`, and
        `interception_h2` for a guest speaking HTTP/2). The guest's handshake runs while the
        server's connection is made and verified for `name` (two handshakes one after the
        other cost a connection twice their time); no request goes anywhere before both are
        done, so a server that is not `name` gets nothing, and the guest sees its connection
        closed."""
        interception = self._interception
        assert interception is not None
        _no_delay(writer)
        guest = GuestTls(reader, writer, interception.ca.server_context(name), head)
        handshake = asyncio.ensure_future(asyncio.wait_for(guest.handshake(), _HEAD_TIMEOUT_S))
        opened: list[asyncio.StreamWriter] = []
        # The server is offered HTTP/2 only if the guest offered it: the proxy then speaks it
        # with the guest too (its own ALPN prefers it), and can pass streams on as streams.
        http2 = "h2" in tls_alpn(head)

        async def connect() -> Stream:
            policy, address, port = destination
            up_reader, up_writer = await self._verified(policy, name, address, port, http2)
            opened.append(up_writer)
            tls = up_writer.get_extra_info("ssl_object")
            alpn = tls.selected_alpn_protocol() if tls is not None else None
            return PlainStream(up_reader, up_writer, alpn)

        try:
            try:
                first = await connect()
            except (OSError, TimeoutError, ssl.SSLError) as e:
                log.debug("slot %s: %s did not verify: %s", self.slot.netns, name, e)
                return
            await handshake
            self._counts.intercepted += 1
            secrets, team = interception.secrets, destination[0].team_id
            tokens = interception.tokens(destination[0].identity)

            def now() -> Headers:
                return resolve(headers, secrets, tokens, team_id=team)

            if guest.alpn == "h2":
                await Bridge(guest, first, connect, now).run()
            elif first.alpn == "h2":  # the guest offered HTTP/2 but did not agree to it
                log.debug("slot %s: %s: the guest and the server disagree", self.slot.netns, name)
            else:
                await exchange(guest, first, now)
        except (
            ssl.SSLError,
            h11.ProtocolError,
            h2.exceptions.ProtocolError,
            ConnectionError,
        ) as e:
            log.debug("slot %s: %s: %s", self.slot.netns, name, e)
        finally:
            handshake.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError, TimeoutError, ssl.SSLError):
                await handshake
            for up_writer in opened:
                up_writer.close()
                with contextlib.suppress(OSError, ssl.SSLError):
                    await up_writer.wait_closed()

    async def _direct(
        self, address: IPv4Address, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to the destination from the slot namespace, as the guest's would be."""
        sock = await netns.run_in(self.slot.netns, _outgoing)
        with contextlib.ExitStack() as undo:
            undo.callback(sock.close)
            loop = asyncio.get_running_loop()
            await asyncio.wait_for(
                loop.sock_connect(sock, (str(address), port)), _CONNECT_TIMEOUT_S
            )
            undo.pop_all()
        return await asyncio.open_connection(sock=sock, limit=_CHUNK)
