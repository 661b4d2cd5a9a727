"""Fixtures for network slot tests: a private stand-in for the host and for the internet, pools
of slots with a random prefix, and fake guests behind slot taps.

Nothing here touches the real host's namespace: the "host" is a namespace of its own, joined to
an "internet" namespace by a veth, as in research/feasibility.md section E. Everything a test
creates is removed in finalizers, also when the test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from ipaddress import IPv4Network
from typing import Any

import pytest

from aenv.network import NetworkConfig, Slot, SlotPool, netns
from tests.network import probes
from tests.network.fakeguest import FakeGuest

# The "internet" has public-looking addresses (documentation ranges, never routed anywhere):
# private ranges are what slots refuse by default.
HOST_UPLINK_IP = "203.0.113.1"
INET_IP = "203.0.113.2"
# A second "internet" destination, for policies that tell destinations apart.
INET_OTHER_IP = "198.51.100.1"
# Addresses in the "internet" namespace that no slot may reach by default (see `reserved`).
INTERNAL_IPS = ("169.254.169.254", "10.250.0.9", "172.16.0.9", "192.168.0.9", "100.64.0.9")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass(frozen=True)
class World:
    host: str
    inet: str
    prefix: str

    def config(self, **overrides: Any) -> NetworkConfig:
        base = NetworkConfig(
            prefix=self.prefix,
            host_netns=self.host,
            slot_network=IPv4Network("10.200.0.0/24"),
            pool_low=0,
            pool_high=0,
        )
        return replace(base, **overrides)

    def leftovers(self) -> list[str]:
        return [n for n in netns.names() if n.startswith(f"{self.prefix}-")]


def skip_unless_root_and_nft() -> None:
    if os.geteuid() != 0 or shutil.which("nft") is None:
        pytest.skip("network slot tests need root and nft")


@contextlib.contextmanager
def new_world() -> Iterator[World]:
    """A fresh host and internet namespace pair, removed with every slot of its prefix on exit."""
    tag = secrets.token_hex(3)
    w = World(host=f"aenv-test-host-{tag}", inet=f"aenv-test-inet-{tag}", prefix=f"t{tag}")
    try:
        _ip("netns", "add", w.host)
        _ip("netns", "add", w.inet)
        _ip("-n", w.host, "link", "set", "lo", "up")
        _ip("-n", w.inet, "link", "set", "lo", "up")
        _ip("-n", w.host, "link", "add", "uplink", "type", "veth", "peer", "eth0", "netns", w.inet)
        _ip("-n", w.host, "addr", "add", f"{HOST_UPLINK_IP}/30", "dev", "uplink")
        _ip("-n", w.inet, "addr", "add", f"{INET_IP}/30", "dev", "eth0")
        for address in (INET_OTHER_IP, *INTERNAL_IPS):
            _ip("-n", w.inet, "addr", "add", f"{address}/32", "dev", "lo")
        _ip("-n", w.host, "link", "set", "uplink", "up")
        _ip("-n", w.inet, "link", "set", "eth0", "up")
        _ip("-n", w.host, "route", "add", "default", "via", INET_IP)
        yield w
    finally:
        for name in w.leftovers():
            netns.remove(name)
        for name in (w.host, w.inet):
            if name in netns.names():
                netns.remove(name)


@pytest.fixture
def world() -> Iterator[World]:
    skip_unless_root_and_nft()
    with new_world() as w:
        yield w


@pytest.fixture
async def make_pool(world: World) -> AsyncIterator[Callable[..., Awaitable[SlotPool]]]:
    """Start a pool of `world`'s slots; extra keyword arguments override its NetworkConfig."""
    pools: list[SlotPool] = []

    async def make(**overrides: Any) -> SlotPool:
        pool = SlotPool(world.config(**overrides))
        pools.append(pool)
        await pool.start()
        return pool

    yield make
    for pool in pools:
        await pool.close()
    assert world.leftovers() == [], "slot namespaces survived SlotPool.close()"


@pytest.fixture
async def pool(make_pool: Callable[..., Awaitable[SlotPool]]) -> SlotPool:
    return await make_pool()


@pytest.fixture
async def boot(
    make_pool: Callable[..., Awaitable[SlotPool]],
) -> AsyncIterator[Callable[[Slot], Awaitable[FakeGuest]]]:
    """Put a fake guest behind a slot's tap. Depends on `make_pool` so guests, which hold the
    slots' taps open, go first at teardown."""
    guests: list[FakeGuest] = []

    async def start(slot: Slot) -> FakeGuest:
        guest = FakeGuest(slot)
        guests.append(guest)
        await guest.start()
        return guest

    yield start
    for guest in guests:
        guest.stop()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[str, str, int, str], Awaitable[None]]]:
    """Start a greeting/echo server (see `probes.serve`), closed at teardown."""
    servers: list[asyncio.Server] = []

    async def start(ns: str, ip: str, port: int, name: str) -> None:
        servers.append(await probes.serve(ns, ip, port, name))

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()
