"""Network slots without namespaces: each slot is a loopback address of its own
(`127.x.y.z`), with envd's port on it bound when the slot is handed out, so a double VM's envd
is reached at `slot.address` exactly as a real guest's is, and two test runs on one machine
never share an address."""

from __future__ import annotations

import errno
import itertools
import random
import socket
from ipaddress import IPv4Address, IPv4Network

from aenv.envd import ENVD_PORT
from aenv.network import EgressPolicy, GuestNetwork, Slot
from aenv.network.reserved import denied_ranges

_TRIES = 100
DOUBLE_CA = b"-----BEGIN CERTIFICATE-----\nZG91Ymxl\n-----END CERTIFICATE-----\n"


class DoubleSlots:
    """A `SlotProvider`; `sockets[netns]` is the bound envd socket a VM in that slot serves on."""

    def __init__(self) -> None:
        self.sockets: dict[str, socket.socket] = {}
        self.in_use: dict[str, Slot] = {}
        self.egress: dict[str, bool] = {}
        self.policies: dict[str, EgressPolicy] = {}
        self.acquired = 0
        self._index = itertools.count()
        # What a node's default network configuration denies (its slot network included).
        self.denied = denied_ranges(IPv4Network("10.11.0.0/16"))
        # Where the host's own addresses are looked up: this process's namespace unless a test
        # gives the node a host of its own.
        self.host_netns: str | None = None
        # What guests with header rules are told to trust; a test sets None for a node
        # without a CA.
        self.egress_ca: bytes | None = DOUBLE_CA

    async def acquire(
        self, *, egress: bool | None = None, policy: EgressPolicy | None = None
    ) -> Slot:
        index = next(self._index)
        address, sock = _bind_free_address()
        slot = Slot(
            index=index,
            netns=f"double-{index}-{address}",
            host_ifname=f"dbl{index}",
            host_ip=address,
            address=address,
            guest=GuestNetwork(),
        )
        self.sockets[slot.netns] = sock
        self.in_use[slot.netns] = slot
        self.egress[slot.netns] = True if egress is None else egress
        if policy is not None:
            self.policies[slot.netns] = policy
        self.acquired += 1
        return slot

    async def release(self, slot: Slot) -> None:
        sock = self.sockets.pop(slot.netns, None)
        if sock is not None:
            sock.close()
        self.in_use.pop(slot.netns, None)

    async def set_egress(self, slot: Slot, enabled: bool) -> None:
        self.egress[slot.netns] = enabled

    async def set_policy(self, slot: Slot, policy: EgressPolicy) -> None:
        self.policies[slot.netns] = policy


def _bind_free_address() -> tuple[IPv4Address, socket.socket]:
    """A random loopback address whose envd port nobody holds, and the socket holding it."""
    for _ in range(_TRIES):
        address = IPv4Address(
            f"127.{random.randint(100, 254)}.{random.randint(0, 255)}.{random.randint(1, 254)}"
        )
        # TCP named, so that asyncio sets TCP_NODELAY (see tests/support/loopback_api.py).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.bind((str(address), ENVD_PORT))
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                continue
            raise
        sock.listen(128)
        sock.setblocking(False)
        return address, sock
    raise RuntimeError("no free loopback address for a double slot")
