"""Egress policy (allow/deny by destination) with real traffic from a fake guest."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from aenv.network import EgressPolicy, Slot, SlotPool
from aenv.network.settings import SandboxNetwork
from tests.network import probes
from tests.network.conftest import HOST_UPLINK_IP, INET_IP, INET_OTHER_IP, World
from tests.network.fakeguest import FakeGuest

ENVD_PORT = 49983

MakePool = Callable[..., Awaitable[SlotPool]]
Boot = Callable[[Slot], Awaitable[FakeGuest]]
Serve = Callable[[str, str, int, str], Awaitable[None]]


async def _reachable(guest: FakeGuest) -> list[bool]:
    replies = await asyncio.gather(
        # Refusals here are rejects, answered at once: the timeout only bounds a loaded machine.
        probes.probe(guest.netns, INET_IP, 80, timeout=3.0),
        probes.probe(guest.netns, INET_OTHER_IP, 80, timeout=3.0),
    )
    return [reply is not None for reply in replies]


@pytest.fixture
async def internet(world: World, serve: Serve) -> None:
    await serve(world.inet, INET_IP, 80, "inet")
    await serve(world.inet, INET_OTHER_IP, 80, "other")


@pytest.mark.usefixtures("internet")
async def test_allow_wins_over_deny_and_policies_change_live(
    world: World, pool: SlotPool, boot: Boot, serve: Serve
) -> None:
    slot = await pool.acquire()
    guest = await boot(slot)
    await serve(guest.netns, str(slot.guest.ip.ip), ENVD_PORT, "envd")
    assert await _reachable(guest) == [True, True]
    open_conn = await probes.connect(guest.netns, INET_IP, 80)
    assert open_conn is not None

    only_other = EgressPolicy.parse(allow=[INET_OTHER_IP], deny=["0.0.0.0/0"])
    await pool.set_policy(slot, only_other)
    assert await _reachable(guest) == [False, True]
    assert not await probes.echo(open_conn, timeout=0.5)  # open connections are judged too
    open_conn[1].close()
    # Denying everything never cuts the host's path to the guest.
    assert await probes.probe(world.host, str(slot.address), ENVD_PORT) == f"envd {slot.host_ip}"

    await pool.set_policy(slot, EgressPolicy.parse(deny=["198.51.100.0/24"]))
    assert await _reachable(guest) == [True, False]
    await pool.set_policy(slot, EgressPolicy())
    assert await _reachable(guest) == [True, True]


@pytest.mark.usefixtures("internet")
async def test_a_policy_cannot_open_the_host(
    world: World, pool: SlotPool, boot: Boot, serve: Serve
) -> None:
    await serve(world.host, "0.0.0.0", 3000, "api")
    assert await probes.probe(world.host, HOST_UPLINK_IP, 3000) is not None
    slot = await pool.acquire(policy=EgressPolicy.parse(allow=["0.0.0.0/0"]))
    guest = await boot(slot)
    assert await _reachable(guest) == [True, True]
    assert await probes.probe(guest.netns, HOST_UPLINK_IP, 3000, timeout=0.5) is None
    assert await probes.probe(guest.netns, str(slot.host_ip), 3000, timeout=0.5) is None


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.usefixtures("internet")
async def test_acquire_with_a_policy(make_pool: MakePool, boot: Boot, warm: bool) -> None:
    pool = await make_pool(pool_low=1, pool_high=1) if warm else await make_pool()
    await pool.wait_idle()
    slot = await pool.acquire(policy=EgressPolicy.parse(deny=[f"{INET_IP}/32"]))
    guest = await boot(slot)
    assert await _reachable(guest) == [False, True]


def test_policy_parsing() -> None:
    policy = EgressPolicy.parse(allow=["1.1.1.1", "8.8.8.0/24", "8.8.8.8"], deny=["10.1.2.3/8"])
    assert [str(n) for n in policy.allow] == ["1.1.1.1/32", "8.8.8.0/24"]
    assert [str(n) for n in policy.deny] == ["10.0.0.0/8"]
    assert EgressPolicy.parse(allow=["1.1.1.1"]) == EgressPolicy.parse(allow=["1.1.1.1/32"])
    for bad in ("example.com", "::1"):
        with pytest.raises(ValueError):
            EgressPolicy.parse(deny=[bad])


def test_sandbox_settings_map_onto_slot_egress() -> None:
    def egress(**settings: Any) -> tuple[bool, list[str], list[str]]:
        result = SandboxNetwork(**settings).egress
        return (
            result.enabled,
            [str(n) for n in result.policy.allow],
            [str(n) for n in result.policy.deny],
        )

    assert egress() == (True, [], [])
    # No internet access is a deny of everything, which an allow still overrides (as in E2B).
    assert egress(allow_internet=False) == (False, [], ["0.0.0.0/0"])
    assert egress(allow_internet=False, allow_out=("1.1.1.1",)) == (
        True,
        ["1.1.1.1/32"],
        ["0.0.0.0/0"],
    )
    assert egress(deny_out=("0.0.0.0/0",)) == (False, [], ["0.0.0.0/0"])
    assert egress(deny_out=("8.8.8.8",)) == (True, [], ["8.8.8.8/32"])
    # Kept as the user wrote them, for the sandbox's info.
    assert SandboxNetwork(allow_out=("8.8.8.8",)).allow_out == ("8.8.8.8",)
    for bad in ("example.com", "2001:db8::/32"):
        with pytest.raises(ValueError):
            SandboxNetwork(deny_out=(bad,))
    # Names need everything else denied; then they open the slot's egress, as addresses do.
    with pytest.raises(ValueError, match="ALL_TRAFFIC"):
        SandboxNetwork(allow_out=("example.com",))
    named = SandboxNetwork(allow_out=("*.example.com",), deny_out=("0.0.0.0/0",)).egress
    assert (named.enabled, named.policy.domains) == (True, ("*.example.com",))
    offline = SandboxNetwork(allow_internet=False, allow_out=("example.com",)).egress
    assert (offline.enabled, offline.policy.domains) == (True, ("example.com",))
