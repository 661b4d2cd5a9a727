"""Slot lifecycle around failures: the warm pool's watermarks, exhaustion, a failed or cancelled
create, and the startup sweep after a crash."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Callable
from ipaddress import IPv4Network

import pytest

from aenv.network import EgressPolicy, NftError, SlotManager, SlotPool, SlotsExhausted, netns, rules
from tests.network.conftest import World

MakePool = Callable[..., Awaitable[SlotPool]]


def _host_links(world: World) -> list[str]:
    out = subprocess.run(
        ["ip", "-n", world.host, "-o", "link"], check=True, capture_output=True, text=True
    ).stdout
    return [line.split(": ")[1].split("@")[0] for line in out.splitlines()]


async def test_pool_refills_below_low_up_to_high(make_pool: MakePool) -> None:
    pool = await make_pool(pool_low=2, pool_high=4)
    await pool.wait_idle()
    assert (pool.ready, pool.in_use) == (4, 0)
    taken = [await pool.acquire(), await pool.acquire()]
    await pool.wait_idle()
    assert (pool.ready, pool.in_use) == (2, 2)  # at the low watermark: no refill yet
    taken.append(await pool.acquire())
    await pool.wait_idle()
    assert (pool.ready, pool.in_use) == (4, 3)
    assert len({s.index for s in taken}) == 3
    for slot in taken:
        await pool.release(slot)
    assert (pool.ready, pool.in_use) == (4, 0)


async def test_empty_pool_creates_on_demand(make_pool: MakePool) -> None:
    pool = await make_pool(pool_low=0, pool_high=0)
    slot = await pool.acquire()
    assert (pool.ready, pool.in_use) == (0, 1)
    await pool.release(slot)


async def test_exhaustion_is_an_error_until_a_slot_is_released(make_pool: MakePool) -> None:
    pool = await make_pool(slot_network=IPv4Network("10.200.0.0/29"), pool_low=1, pool_high=4)
    await pool.wait_idle()
    assert pool.ready == 2  # the refill stops quietly at capacity
    a, b = await pool.acquire(), await pool.acquire()
    with pytest.raises(SlotsExhausted):
        await pool.acquire()
    await pool.release(a)
    c = await pool.acquire()
    assert c.index == a.index
    for slot in (b, c):
        await pool.release(slot)


async def test_failed_create_leaves_nothing(
    world: World, make_pool: MakePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = await make_pool(slot_network=IPv4Network("10.200.0.0/30"))
    good = rules.slot_table
    # The last step of a create fails: the nft batch jumps to a chain that does not exist.
    bad_rule = {
        "family": "inet",
        "table": "aenv",
        "chain": "forward",
        "expr": [{"jump": {"target": "nope"}}],
    }
    broken = [*good(pool.config.guest, EgressPolicy(), ()), {"add": {"rule": bad_rule}}]
    monkeypatch.setattr(rules, "slot_table", lambda guest, policy, denied: broken)
    with pytest.raises(NftError):
        await pool.acquire()
    assert world.leftovers() == []
    monkeypatch.setattr(rules, "slot_table", good)
    slot = await pool.acquire()  # the index was given back
    await pool.release(slot)


async def test_cancelled_create_is_reclaimed(world: World, make_pool: MakePool) -> None:
    pool = await make_pool()
    task = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0)  # the create's thread is under way
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await pool.close()  # waits for the orphaned create and removes what it built
    assert world.leftovers() == []


_CRASHER = """
import asyncio, sys
from aenv.network import NetworkConfig, SlotManager

async def main():
    manager = SlotManager(NetworkConfig(prefix=sys.argv[1], host_netns=sys.argv[2]))
    await manager.start()
    for _ in range(3):
        await manager.create()
    print("ready", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_startup_sweep_after_a_killed_server(world: World, make_pool: MakePool) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CRASHER, world.prefix, world.host, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        assert await proc.stdout.readline() == b"ready\n"
    finally:
        proc.kill()
        await proc.wait()
    assert len(world.leftovers()) == 3
    pool = await make_pool()
    assert world.leftovers() == []
    assert not [name for name in _host_links(world) if name.startswith(f"{world.prefix}-")]
    slot = await pool.acquire()
    await pool.release(slot)


async def test_startup_sweep_reclaims_a_crashed_process_slots(
    world: World, make_pool: MakePool
) -> None:
    crashed = SlotManager(world.config())
    await crashed.start()
    old = [await crashed.create() for _ in range(3)]
    # Things that only look alike stay: another prefix's namespace, a non-slot name.
    bystanders = [f"{world.prefix}-guest", f"{world.prefix}x-1"]
    for name in bystanders:
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                world.host,
                "nft",
                "add",
                "rule",
                "inet",
                world.prefix,
                "input",
                "counter",
            ],
            check=True,
        )
        # The crashed process is gone without cleaning up; a new one starts with the same prefix.
        pool = await make_pool()
        assert world.leftovers() == bystanders[:1] and bystanders[1] in netns.names()
        assert not {s.host_ifname for s in old} & set(_host_links(world))
        ruleset = subprocess.run(
            ["ip", "netns", "exec", world.host, "nft", "list", "table", "inet", world.prefix],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        assert "counter" not in ruleset and "masquerade" in ruleset
        slot = await pool.acquire()
        assert slot.index == 0  # names are free again
        await pool.release(slot)
    finally:
        for name in bystanders:
            netns.remove(name)


async def test_a_taken_name_is_left_alone(world: World, make_pool: MakePool) -> None:
    pool = await make_pool(slot_network=IPv4Network("10.200.0.0/30"))
    taken = f"{world.prefix}-0"  # appears after the startup sweep, e.g. made by someone else
    subprocess.run(["ip", "netns", "add", taken], check=True)
    try:
        with pytest.raises(FileExistsError):
            await pool.acquire()
        assert taken in netns.names()
    finally:
        netns.remove(taken)


async def test_concurrent_acquires_and_releases(world: World, make_pool: MakePool) -> None:
    pool = await make_pool(pool_low=4, pool_high=4)  # a refill races with the cold creates
    slots = await asyncio.gather(*(pool.acquire() for _ in range(16)))
    assert len({s.index for s in slots}) == len({s.address for s in slots}) == 16
    assert {s.netns for s in slots} <= set(world.leftovers())
    await asyncio.gather(*(pool.release(s) for s in slots))
    await pool.wait_idle()
    assert (pool.ready, pool.in_use) == (4, 0)


async def test_leaked_slots_and_stray_namespaces_are_reclaimed(
    world: World, make_pool: MakePool
) -> None:
    pool = await make_pool(pool_low=1, pool_high=2)
    await pool.wait_idle()
    leaked = await asyncio.create_task(pool.acquire())  # its task ended without a release
    kept = await asyncio.create_task(pool.acquire())  # handed to a long-lived holder
    own = await pool.acquire()  # held by this task, which still runs
    await pool.wait_idle()
    # No slot stands for these: a create's failed clean-up, a slot of a wider network.
    strays = [f"{world.prefix}-9", f"{world.prefix}-99999"]
    for stray in strays:
        subprocess.run(["ip", "netns", "add", stray], check=True)
    foreign = f"{world.prefix}x-0"  # not a name of this pool's slots
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    try:
        reclaimed = await pool.reclaim_leaked([kept])
        assert reclaimed == [leaked.netns, *strays]
        names = netns.names()
        assert not {leaked.netns, *strays} & set(names) and foreign in names
        assert {kept.netns, own.netns} <= set(names)
        assert (pool.ready, pool.in_use) == (2, 2)
        assert await pool.reclaim_leaked([kept]) == []  # nothing twice
    finally:
        netns.remove(foreign)
    await pool.release(kept)
    await pool.release(own)
