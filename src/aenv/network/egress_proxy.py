"""Domain egress rules: a slot's TCP connections judged by the name they ask for.

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
   answers only for allowed names.

The name is what the client claims, as in E2B: a client that resolves a name itself and sends
it to another address reaches that address. Addresses are still judged: the reserved ranges
are never reachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from ipaddress import IPv4Address, IPv4Network

from aenv.network import netns
from aenv.network.dns import DnsForwarder
from aenv.network.domains import DomainRules
from aenv.network.slot import Slot
from aenv.network.sniff import Need, requested_name

log = logging.getLogger(__name__)

PROXY_PORT = 15001
_SO_ORIGINAL_DST = 80
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


class DomainProxy:
    """The proxy of one slot. `rules` may be replaced at any time; connections already relayed
    keep going (E2B judges a connection when it starts)."""

    def __init__(
        self,
        slot: Slot,
        rules: DomainRules,
        denied: tuple[IPv4Network, ...],
        dns_upstream: IPv4Address,
    ) -> None:
        self.slot = slot
        self._rules = rules
        self._denied = denied
        self._dns = DnsForwarder(slot, rules, dns_upstream)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def rules(self) -> DomainRules:
        return self._rules

    @rules.setter
    def rules(self, rules: DomainRules) -> None:
        self._rules = rules
        self._dns.rules = rules

    async def start(self) -> None:
        gateway = str(self.slot.guest.gateway)
        sock = await netns.run_in(self.slot.netns, lambda: _listener(gateway))
        self._server = await asyncio.start_server(self._accepted, sock=sock)
        try:
            await self._dns.start()
        except BaseException:
            await self.close()
            raise

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
        except (OSError, TimeoutError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    def _allowed(self, name: str | None, address: IPv4Address) -> bool:
        if name is None or not self.rules.allows(name):
            return False
        return not any(address in network for network in self._denied)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        address, port = original_destination(writer.get_extra_info("socket"))
        head, name = await asyncio.wait_for(_head(reader), _HEAD_TIMEOUT_S)
        if not self._allowed(name, address):
            # Debug, not info: a guest decides how often this happens.
            log.debug("slot %s: refused %s (%s:%d)", self.slot.netns, name, address, port)
            return
        sock = await netns.run_in(self.slot.netns, _outgoing)
        try:
            loop = asyncio.get_running_loop()
            await asyncio.wait_for(
                loop.sock_connect(sock, (str(address), port)), _CONNECT_TIMEOUT_S
            )
        except BaseException:
            sock.close()
            raise
        up_reader, up_writer = await asyncio.open_connection(sock=sock, limit=_CHUNK)
        try:
            up_writer.write(head)
            await asyncio.gather(_relay(reader, up_writer), _relay(up_reader, writer))
        finally:
            up_writer.close()
            with contextlib.suppress(OSError):
                await up_writer.wait_closed()
