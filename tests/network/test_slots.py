"""Network slots with real namespaces, taps, veths and nftables, and real traffic through them."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import Awaitable, Callable
from ipaddress import IPv4Network
from typing import Any

import pytest

from aenv.network import Slot, SlotPool
from tests.network import probes
from tests.network.conftest import HOST_UPLINK_IP, INET_IP, World
from tests.network.fakeguest import FakeGuest
from tests.support.wait import eventually

ENVD_PORT = 49983

MakePool = Callable[..., Awaitable[SlotPool]]
Boot = Callable[[Slot], Awaitable[FakeGuest]]
Serve = Callable[[str, str, int, str], Awaitable[None]]


def _links(ns: str) -> dict[str, Any]:
    out = subprocess.run(
        ["ip", "-n", ns, "-j", "-d", "addr"], check=True, capture_output=True, text=True
    ).stdout
    return {link["ifname"]: link for link in json.loads(out)}


def _ruleset(ns: str) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", ns, "nft", "list", "ruleset"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


async def _eventually_gone(world: World, ifnames: list[str]) -> None:
    # The kernel removes a dropped namespace's devices asynchronously.
    await eventually(
        lambda: not set(ifnames) & set(_links(world.host)), f"host interfaces {ifnames} removed"
    )


async def test_slot_has_tap_veth_and_addresses(world: World, pool: SlotPool) -> None:
    a = await pool.acquire()
    b = await pool.acquire()
    assert (a.netns, a.host_ifname) == (f"{world.prefix}-{a.index}",) * 2
    assert a.address != b.address and a.host_ip != b.host_ip
    assert a.netns_path.exists()
    inside = _links(a.netns)
    tap = inside[a.guest.tap]
    assert tap["address"] == a.guest.gateway_mac
    assert tap["linkinfo"]["info_kind"] == "tun"
    assert tap["linkinfo"]["info_data"] == {
        "type": "tap",
        "pi": False,
        "vnet_hdr": False,
        "multi_queue": False,
        "persist": True,
    }
    assert [(x["local"], x["prefixlen"]) for x in tap["addr_info"]] == [(str(a.guest.gateway), 24)]
    assert [x["local"] for x in inside["eth0"]["addr_info"]] == [str(a.address)]
    outside = _links(world.host)[a.host_ifname]
    assert [x["local"] for x in outside["addr_info"] if x["family"] == "inet"] == [str(a.host_ip)]


async def test_host_reaches_guest_on_any_port(
    world: World, pool: SlotPool, boot: Boot, serve: Serve
) -> None:
    slot = await pool.acquire()
    guest = await boot(slot)
    await serve(guest.netns, str(slot.guest.ip.ip), ENVD_PORT, "envd")
    await serve(guest.netns, str(slot.guest.ip.ip), 8080, "app")
    assert await probes.probe(world.host, str(slot.address), ENVD_PORT) == f"envd {slot.host_ip}"
    assert await probes.probe(world.host, str(slot.address), 8080) == f"app {slot.host_ip}"


async def test_same_guest_ip_everywhere_each_reached_at_its_own_address(
    world: World, pool: SlotPool, boot: Boot, serve: Serve
) -> None:
    slots = [await pool.acquire() for _ in range(3)]
    assert len({s.guest for s in slots}) == 1
    for i, slot in enumerate(slots):
        guest = await boot(slot)
        await serve(guest.netns, str(slot.guest.ip.ip), ENVD_PORT, f"guest{i}")
    for i, slot in enumerate(slots):
        reply = await probes.probe(world.host, str(slot.address), ENVD_PORT)
        assert reply == f"guest{i} {slot.host_ip}"


async def test_egress_is_masqueraded_and_switchable(
    world: World, pool: SlotPool, boot: Boot, serve: Serve
) -> None:
    await serve(world.inet, INET_IP, 80, "inet")
    slot = await pool.acquire()
    guest = await boot(slot)
    # The internet sees the host's uplink address, never the guest's or the slot's.
    assert await probes.probe(guest.netns, INET_IP, 80) == f"inet {HOST_UPLINK_IP}"

    conn = await probes.connect(guest.netns, INET_IP, 80)
    assert conn is not None and await probes.echo(conn)
    await pool.set_egress(slot, False)
    assert await probes.probe(guest.netns, INET_IP, 80, timeout=0.5) is None
    # Switching egress off also cuts connections that were already open.
    assert not await probes.echo(conn, timeout=0.5)
    conn[1].close()

    await pool.set_egress(slot, True)
    assert await probes.probe(guest.netns, INET_IP, 80) == f"inet {HOST_UPLINK_IP}"


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
async def test_egress_off_keeps_the_host_path(
    world: World, make_pool: MakePool, boot: Boot, serve: Serve, warm: bool
) -> None:
    pool = await make_pool(pool_low=1, pool_high=1) if warm else await make_pool()
    await pool.wait_idle()
    await serve(world.inet, INET_IP, 80, "inet")
    slot = await pool.acquire(egress=False)
    guest = await boot(slot)
    await serve(guest.netns, str(slot.guest.ip.ip), ENVD_PORT, "envd")
    assert await probes.probe(guest.netns, INET_IP, 80, timeout=0.5) is None
    assert await probes.probe(world.host, str(slot.address), ENVD_PORT) == f"envd {slot.host_ip}"


async def test_slots_are_isolated_from_each_other_and_from_the_host(
    world: World, pool: SlotPool, boot: Boot, serve: Serve
) -> None:
    a, b = await pool.acquire(), await pool.acquire()
    guest_a, guest_b = await boot(a), await boot(b)
    await serve(guest_b.netns, str(b.guest.ip.ip), ENVD_PORT, "b")
    await serve(world.host, "0.0.0.0", 3000, "api")  # the host's API port, on every address
    await serve(world.host, "127.0.0.1", 5432, "loopback-only")
    # Controls: the host reaches its own services and slot b; a reaches the internet.
    assert await probes.probe(world.host, "127.0.0.1", 3000) == "api 127.0.0.1"
    assert await probes.probe(world.host, "127.0.0.1", 5432) == "loopback-only 127.0.0.1"
    assert await probes.probe(world.host, str(b.address), ENVD_PORT) is not None

    forbidden = [
        (str(b.address), ENVD_PORT),  # another slot's guest
        (str(b.host_ip), 3000),  # another slot's host end
        (str(a.host_ip), 3000),  # the host through a's own gateway
        (HOST_UPLINK_IP, 3000),  # the host's other addresses
        ("127.0.0.1", 3000),
        ("127.0.0.1", 5432),
    ]
    results = await asyncio.gather(
        *(probes.probe(guest_a.netns, ip, port, timeout=0.5) for ip, port in forbidden)
    )
    assert results == [None] * len(forbidden)


async def test_only_the_host_opens_connections_into_a_slot(
    world: World, pool: SlotPool, boot: Boot, serve: Serve
) -> None:
    slot = await pool.acquire()
    guest = await boot(slot)
    await serve(guest.netns, str(slot.guest.ip.ip), ENVD_PORT, "envd")
    # Even with a route to the slot network, the outside cannot reach the slot.
    subprocess.run(
        ["ip", "-n", world.inet, "route", "add", "10.200.0.0/24", "via", HOST_UPLINK_IP],
        check=True,
    )
    assert await probes.probe(world.inet, str(slot.address), ENVD_PORT, timeout=0.5) is None


async def test_teardown_leaves_nothing(world: World, pool: SlotPool, boot: Boot) -> None:
    host_rules = _ruleset(world.host)
    slots = [await pool.acquire() for _ in range(4)]
    guest = await boot(slots[0])
    guest.stop()  # a VMM exits before its slot is released
    for slot in slots:
        await pool.release(slot)
    assert world.leftovers() == []
    await _eventually_gone(world, [s.host_ifname for s in slots])
    # The host table is static: no per-slot element to forget.
    assert _ruleset(world.host) == host_rules
    await pool.close()
    assert _ruleset(world.host) == ""


async def test_an_index_is_reused_while_its_old_slot_still_drains(
    world: World, make_pool: MakePool, boot: Boot, serve: Serve
) -> None:
    pool = await make_pool(slot_network=IPv4Network("10.200.0.0/30"))  # room for one slot
    first = await pool.acquire()
    await pool.release(first)
    again = await pool.acquire()
    assert again.index == first.index and again.address == first.address
    guest = await boot(again)
    await serve(guest.netns, str(again.guest.ip.ip), ENVD_PORT, "again")
    assert await probes.probe(world.host, str(again.address), ENVD_PORT) is not None


@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="needs qemu-system-x86_64")
async def test_a_vmm_attaches_to_the_tap_from_inside_the_slot(pool: SlotPool) -> None:
    """The contract with the runtime: the VMM runs in the slot's namespace and opens its tap by
    name. QEMU is started paused (no guest needed); once it holds the tap, the tap has carrier."""
    slot = await pool.acquire()
    netdev = f"tap,id=n0,ifname={slot.guest.tap},script=no,downscript=no"
    device = f"virtio-net-device,netdev=n0,mac={slot.guest.mac}"
    qemu = (
        "qemu-system-x86_64 -M microvm -S -nodefaults -no-user-config -display none -monitor none"
    )
    argv = ["ip", "netns", "exec", slot.netns, *qemu.split(), "-netdev", netdev, "-device", device]
    vmm = subprocess.Popen(argv, stderr=subprocess.PIPE)
    try:
        await eventually(
            lambda: (
                "LOWER_UP" in _links(slot.netns)[slot.guest.tap]["flags"] or vmm.poll() is not None
            ),
            "QEMU opened the tap, or exited",
        )
        assert vmm.poll() is None, vmm.communicate()[1]
        assert "LOWER_UP" in _links(slot.netns)[slot.guest.tap]["flags"]
    finally:
        vmm.kill()
        vmm.communicate()
    await pool.release(slot)
