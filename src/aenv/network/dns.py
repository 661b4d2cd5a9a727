"""DNS for slots with domain egress rules: answers consistent with the rules.

The slot table redirects the guest's DNS queries (UDP port 53, whichever resolver it asks) to
this forwarder on the guest's gateway address, inside the slot namespace. A query for a name the
rules allow is forwarded and its answer relayed; any other name is answered NXDOMAIN, so a
sandbox neither learns addresses it may not use nor leaks names through DNS. What is forwarded
is a query the forwarder writes itself, with the guest's question and id (a standard query, no
options): a guest cannot send the resolver anything else (an update, a notify) through it.
Messages are read and written with dnspython.

Where a query goes:

- The node's resolver (configured, else the host's own: `host_resolver`) is the operator's
  choice and is always asked, from the host namespace, as the host asks it. Cloud hosts
  resolve through a resolver in a private or link-local range (a VPC's 10.0.0.2, AWS's
  169.254.169.253), which slots may not reach; the guest still reaches nothing there but
  answers for its allowed names.
- A sandbox may name its own resolvers instead (E2B's `dnsServers`): they are asked in order,
  the next when one does not answer in time, from the slot namespace, as the guest's own
  traffic leaves. The API refuses one in a range slots may not reach (`reserved`); should one
  get here anyway it is never asked. An empty list answers every query REFUSED.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from ipaddress import IPv4Address, IPv4Network, ip_address
from pathlib import Path
from typing import cast

import dns.exception
import dns.flags
import dns.message
import dns.opcode
import dns.rcode

from aenv.network import netns
from aenv.network.domains import DomainRules
from aenv.network.slot import Slot

log = logging.getLogger(__name__)

DNS_PORT = 53
_UPSTREAM_TIMEOUT_S = 3.0
_MAX_MESSAGE = 4096
FALLBACK_RESOLVER = IPv4Address("1.1.1.1")


def host_resolver(resolv_conf: Path = Path("/etc/resolv.conf")) -> IPv4Address:
    """The host's first IPv4 nameserver, else `FALLBACK_RESOLVER`. One on loopback (systemd's
    stub at 127.0.0.53) serves too: the node's resolver is asked from the host namespace."""
    try:
        lines = resolv_conf.read_text().splitlines()
    except OSError:
        return FALLBACK_RESOLVER
    for line in lines:
        fields = line.split()
        if len(fields) < 2 or fields[0] != "nameserver":
            continue
        try:
            address = ip_address(fields[1])
        except ValueError:
            continue
        if isinstance(address, IPv4Address):
            return address
    return FALLBACK_RESOLVER


def _udp(bind: tuple[str, int] | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if bind is not None:
        sock.bind(bind)
    sock.setblocking(False)
    return sock


class _Server(asyncio.DatagramProtocol):
    def __init__(self, forwarder: DnsForwarder) -> None:
        self._forwarder = forwarder
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The selector loop's datagram transport does not subclass DatagramTransport.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        self._forwarder.spawn(self._answer(data, addr))

    async def _answer(self, data: bytes, addr: tuple[str | object, int]) -> None:
        reply = await self._forwarder.answer(data)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


class DnsForwarder:
    """The forwarder of one slot. `rules` and `own` (the sandbox's resolvers, None: the
    node's) may be replaced at any time."""

    def __init__(
        self,
        slot: Slot,
        rules: DomainRules,
        own: tuple[IPv4Address, ...] | None,
        node_resolver: IPv4Address,
        host_netns: str | None,
        denied: tuple[IPv4Network, ...],
    ) -> None:
        self.slot = slot
        self.rules = rules
        self.own = own
        self._node = node_resolver
        self._host_netns = host_netns
        self._denied = denied
        self._transport: asyncio.DatagramTransport | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        bind = (str(self.slot.guest.gateway), DNS_PORT)
        sock = await netns.run_in(self.slot.netns, lambda: _udp(bind))
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: _Server(self), sock=sock)
        self._transport = transport

    async def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def spawn(self, work: object) -> None:
        assert asyncio.iscoroutine(work)
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _upstreams(self) -> list[tuple[IPv4Address, str | None]]:
        """Where to ask, in order, each with the namespace to ask it from."""
        if self.own is None:
            return [(self._node, self._host_netns)]
        own = [u for u in self.own if not any(u in n for n in self._denied)]
        return [(u, self.slot.netns) for u in own]

    async def answer(self, data: bytes) -> bytes | None:
        """The reply to the query `data`, or None to drop it (not a query we can read)."""
        try:
            query = dns.message.from_wire(data)
        except dns.exception.DNSException:
            return None
        if query.opcode() != dns.opcode.QUERY:
            return _reply(query, dns.rcode.NOTIMP)
        if len(query.question) != 1:
            return _reply(query, dns.rcode.FORMERR)
        name = query.question[0].name.to_text(omit_final_dot=True)
        if not self.rules.allows(name):
            return _reply(query, dns.rcode.NXDOMAIN)
        if self.own == ():
            return _reply(query, dns.rcode.REFUSED)
        upstreams = self._upstreams()
        forwarded = _forwarded(query)
        timeout = _UPSTREAM_TIMEOUT_S / max(len(upstreams), 1)
        for upstream, namespace in upstreams:
            try:
                return await asyncio.wait_for(
                    self._forward(forwarded, query.id, upstream, namespace), timeout
                )
            except (OSError, TimeoutError):
                log.debug("slot %s: no answer from %s for %s", self.slot.netns, upstream, name)
        return _reply(query, dns.rcode.SERVFAIL)

    async def _forward(
        self, data: bytes, query_id: int, upstream: IPv4Address, namespace: str | None
    ) -> bytes:
        sock = await netns.run_in(namespace, _udp)
        loop = asyncio.get_running_loop()
        address = (str(upstream), DNS_PORT)
        try:
            await loop.sock_sendto(sock, data, address)
            while True:
                reply, source = await loop.sock_recvfrom(sock, _MAX_MESSAGE)
                # Only the resolver's answer to this query, not a spoofed or stray datagram.
                if source == address and reply[:2] == query_id.to_bytes(2, "big"):
                    return reply
        finally:
            sock.close()


def _forwarded(query: dns.message.Message) -> bytes:
    """The query to send upstream: the guest's question, id and recursion and DNSSEC wishes,
    and nothing else of what it sent."""
    question = query.question[0]
    edns = query.edns >= 0
    forwarded = dns.message.make_query(
        question.name,
        question.rdtype,
        question.rdclass,
        use_edns=0 if edns else False,
        want_dnssec=bool(query.ednsflags & dns.flags.DO),
        payload=min(query.payload, _MAX_MESSAGE) if edns else None,
        id=query.id,
        flags=query.flags & (dns.flags.RD | dns.flags.CD),
    )
    return forwarded.to_wire()


def _reply(query: dns.message.Message, rcode: dns.rcode.Rcode) -> bytes:
    response = dns.message.make_response(query)
    response.set_rcode(rcode)
    return response.to_wire()
