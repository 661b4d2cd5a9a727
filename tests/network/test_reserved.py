"""Reserved destinations (link-local, private, CGNAT, other slots) and who may reach slot
addresses, with real traffic from fake guests and from another local user."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable
from ipaddress import IPv4Network

import pytest

from aenv.network import EgressPolicy, NetworkConfig, Slot, SlotPool
from aenv.network.reserved import denied_ranges
from tests.network import probes
from tests.network.conftest import INET_IP, INTERNAL_IPS, World
from tests.network.fakeguest import FakeGuest

ENVD_PORT = 49983
NOBODY = 65534

MakePool = Callable[..., Awaitable[SlotPool]]
Boot = Callable[[Slot], Awaitable[FakeGuest]]
Serve = Callable[[str, str, int, str], Awaitable[None]]


@pytest.fixture
async def internet(world: World, serve: Serve) -> None:
    for address in (INET_IP, *INTERNAL_IPS):
        await serve(world.inet, address, 80, address)


async def _reached(guest: FakeGuest, addresses: tuple[str, ...]) -> set[str]:
    replies = await asyncio.gather(
        # Refusals here are rejects, answered at once: the timeout only bounds a loaded machine.
        *(probes.probe(guest.netns, a, 80, timeout=3.0) for a in addresses)
    )
    return {a for a, reply in zip(addresses, replies, strict=True) if reply is not None}


@pytest.mark.usefixtures("internet")
async def test_internal_ranges_are_refused_whatever_the_policy(
    pool: SlotPool, boot: Boot, serve: Serve
) -> None:
    everything = EgressPolicy.parse(allow=["0.0.0.0/0"])
    slot = await pool.acquire(policy=everything)
    other = await pool.acquire(policy=everything)
    guest = await boot(slot)
    other_guest = await boot(other)
    await serve(other_guest.netns, str(other.guest.ip.ip), 80, "other")
    assert await _reached(guest, (INET_IP, *INTERNAL_IPS)) == {INET_IP}
    # Another sandbox, at its slot address, is as unreachable as any internal host.
    assert await probes.probe(guest.netns, str(other.address), 80, timeout=0.5) is None


@pytest.mark.usefixtures("internet")
async def test_the_operator_opts_in_parts_of_the_private_ranges(
    make_pool: MakePool, boot: Boot
) -> None:
    pool = await make_pool(private_allowed=(IPv4Network("10.250.0.0/16"),))
    guest = await boot(await pool.acquire())
    assert await _reached(guest, (INET_IP, *INTERNAL_IPS)) == {INET_IP, "10.250.0.9"}


def test_the_guest_network_stays_denied_whatever_the_operator_opens() -> None:
    config = NetworkConfig(private_allowed=(IPv4Network("10.0.0.0/8"),))
    assert any(n.supernet_of(config.guest.ip.network) for n in config.denied)
    assert any(n.supernet_of(config.slot_network) for n in config.denied)
    assert not any(n.overlaps(IPv4Network("10.250.0.0/16")) for n in config.denied)


def test_denied_ranges() -> None:
    slots = IPv4Network("10.200.0.0/16")
    everything_private = [IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12")]
    denied = denied_ranges(slots, everything_private, [IPv4Network("198.18.0.0/15")])
    as_text = {str(n) for n in denied}
    # Opting in all of 10/8 still leaves the slot network and the always-denied ranges.
    assert {"10.200.0.0/16", "169.254.0.0/16", "127.0.0.0/8", "198.18.0.0/15"} <= as_text
    assert {"192.168.0.0/16", "100.64.0.0/10"} <= as_text
    assert not any(n.overlaps(IPv4Network("172.16.0.0/12")) for n in denied)
    assert not any(n.overlaps(IPv4Network("10.199.0.0/16")) for n in denied)
    partial = denied_ranges(slots, [IPv4Network("192.168.1.0/24")])
    assert not any(n.overlaps(IPv4Network("192.168.1.0/24")) for n in partial)
    assert any(n.supernet_of(IPv4Network("192.168.2.0/24")) for n in partial)


def _connects_as(uid: int, ns: str, address: str, port: int) -> bool:
    """Whether a process of `uid` in `ns` can open a TCP connection to address:port."""
    code = (
        "import socket, sys\n"
        f"s = socket.create_connection(({address!r}, {port}), timeout=2)\n"
        "sys.exit(0 if s.recv(64) else 1)\n"
    )
    argv = ["nsenter", f"--net=/run/netns/{ns}", "--", "setpriv", f"--reuid={uid}",
            f"--regid={uid}", "--clear-groups", sys.executable, "-c", code]  # fmt: skip
    return subprocess.run(argv, capture_output=True, timeout=30, check=False).returncode == 0


async def test_only_the_server_user_reaches_slot_addresses(
    world: World, pool: SlotPool, boot: Boot, serve: Serve
) -> None:
    slot = await pool.acquire()
    guest = await boot(slot)
    await serve(guest.netns, str(slot.guest.ip.ip), ENVD_PORT, "envd")
    await serve(world.inet, INET_IP, 80, "inet")
    address = str(slot.address)
    assert await asyncio.to_thread(_connects_as, 0, world.host, address, ENVD_PORT)
    assert not await asyncio.to_thread(_connects_as, NOBODY, world.host, address, ENVD_PORT)
    # Only slot addresses are the server's: the user's other traffic goes where it did.
    assert await asyncio.to_thread(_connects_as, NOBODY, world.host, INET_IP, 80)


async def test_guests_have_no_ipv6_path(pool: SlotPool, boot: Boot) -> None:
    """IPv6's private and link-local ranges need no list: nothing IPv6 leaves a slot, which has
    no IPv6 on any interface (and its forward chain passes only the guest's IPv4 address)."""
    slot = await pool.acquire(policy=EgressPolicy.parse(allow=["0.0.0.0/0"]))
    await boot(slot)
    out = subprocess.run(
        ["ip", "-n", slot.netns, "-6", "-j", "addr"], check=True, capture_output=True, text=True
    ).stdout
    assert [a for link in json.loads(out) for a in link.get("addr_info", [])] == []
    disabled = subprocess.run(
        ["ip", "netns", "exec", slot.netns, "cat", "/proc/sys/net/ipv6/conf/all/disable_ipv6"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    assert disabled.strip() == "1"
