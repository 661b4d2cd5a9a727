"""Warm pools and admission by memory on the double driver and slots: pool hits and misses,
refills sized to the creates, pooled VMs kept out of the API and removed at shutdown and after a
crash, closed egress until the take, and memory refusals that give pooled VMs back first."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
from prometheus_client import generate_latest

from aenv.api.metrics import NodeMetrics
from aenv.network import EgressPolicy
from aenv.network.settings import SandboxNetwork
from aenv.orchestrator import pooling, warm
from aenv.orchestrator.admission import Refusal
from aenv.orchestrator.lifecycle import CapacityReached
from aenv.orchestrator.states import SandboxState
from aenv.orchestrator.warm import WarmPools
from tests.doubles.node import DoubleNode, assert_clean, double_node, make_template
from tests.support.wait import eventually


@pytest.fixture(autouse=True)
def quick_refills(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refill waits for a second without creates before it restores (not to compete with
    them for the CPU). No test here is about that wait, and each waited it out at every refill:
    10 to 20 s of sleeping in this file."""
    monkeypatch.setattr(pooling, "REFILL_QUIET", 0.02)


def pool_ready(node: DoubleNode, size: int) -> bool:
    return node.orchestrator.pools.sizes().get("base", 0) == size


async def test_a_miss_refills_and_the_next_create_hits(tmp_path: Path) -> None:
    async with double_node(tmp_path, pool_max=2) as node:
        orc = node.orchestrator
        first, _ = await orc.create(node.request())
        assert orc.pools.counters.misses["base"] == 1
        await eventually(lambda: pool_ready(node, 1))  # one create in the last minute: one VM
        [pooled] = list(orc.pools)
        restores = node.driver.calls["restore"]
        second, _ = await orc.create(node.request(env_vars={"A": "2"}))
        assert second.id == pooled.sandbox_id and orc.pools.counters.hits["base"] == 1
        assert node.driver.calls["restore"] == restores  # no restore on the create's path
        guest = node.guest(second.id)
        # Once rehearsed in the pool (the take's then runs translated code), once at the take.
        assert guest.inits == 2 and guest.token == second.envd_access_token
        assert guest.hostname == second.id and guest.env["A"] == "2"
        assert guest.env["E2B_SANDBOX_ID"] == second.id
        assert not (node.config.paths.sandboxes / second.id / warm.MARKER).exists()
        await eventually(lambda: pool_ready(node, 2))  # two creates: the pool grows to two
        assert orc.pools.counters.refills["base"] == 3
        text = generate_latest(NodeMetrics(orc).registry).decode()
        for line in (
            'aenv_pool_vms{template="base"} 2.0',
            'aenv_pool_hits_total{template="base"} 1.0',
            'aenv_pool_misses_total{template="base"} 1.0',
            'aenv_pool_refills_total{template="base"} 3.0',
            'aenv_create_refusals_total{reason="memory"} 0.0',
        ):
            assert line in text
        for record in (first, second):
            assert await orc.kill(record.id)


async def test_pooled_vms_are_invisible_and_gone_after_shutdown(tmp_path: Path) -> None:
    async with double_node(tmp_path, pool_max=1) as node:
        orc = node.orchestrator
        record, _ = await orc.create(node.request())
        await eventually(lambda: pool_ready(node, 1))
        [pooled] = list(orc.pools)
        assert [r.id for r in orc.list()] == [record.id]
        assert node.catalog.get(pooled.sandbox_id) is None
        assert node.catalog.count(frozenset(SandboxState)) == 1
        assert await orc.kill(record.id)
    assert_clean(node)  # the double node closed the orchestrator: the pool went with it


async def test_a_crashed_servers_pooled_vms_are_removed_at_start(tmp_path: Path) -> None:
    async with double_node(tmp_path, pool_max=1) as node:
        record, _ = await node.orchestrator.create(node.request())
        await eventually(lambda: pool_ready(node, 1))
        [pooled] = list(node.orchestrator.pools)
        pooled_dir = node.config.paths.sandboxes / pooled.sandbox_id
        assert (pooled_dir / warm.MARKER).exists()
        # A restarted server over the same data: the previous one never closed its pools.
        restarted = node.reopen()
        await restarted.orchestrator.start()
        try:
            assert not pooled_dir.exists()
            assert not (node.config.paths.sandboxes / record.id).exists()  # running: reclaimed
        finally:
            await restarted.orchestrator.close()
            restarted.catalog.close()


async def test_a_pooled_slot_has_no_egress_until_taken(tmp_path: Path) -> None:
    async with double_node(tmp_path, pool_max=1) as node:
        orc = node.orchestrator
        await orc.create(node.request())
        await eventually(lambda: pool_ready(node, 1))
        [pooled] = list(orc.pools)
        netns = pooled.slot.netns
        assert node.slots.egress[netns] is False
        assert node.slots.policies[netns] == EgressPolicy()
        network = SandboxNetwork(allow_out=("1.2.3.4",), deny_out=("0.0.0.0/0",))
        taken, _ = await orc.create(node.request(network=network))
        assert taken.id == pooled.sandbox_id
        assert node.slots.egress[netns] is True
        assert node.slots.policies[netns] == network.egress.policy


async def test_two_pooled_sandboxes_have_their_own_identity(tmp_path: Path) -> None:
    async with double_node(tmp_path, pool_max=2) as node:
        orc = node.orchestrator
        for _ in range(2):
            await orc.create(node.request())
        await eventually(lambda: pool_ready(node, 2))
        pooled = {p.sandbox_id for p in orc.pools}
        a, _ = await orc.create(node.request(env_vars={"WHO": "a"}))
        b, _ = await orc.create(node.request(env_vars={"WHO": "b"}))
        assert {a.id, b.id} == pooled
        ga, gb = node.guest(a.id), node.guest(b.id)
        assert (ga.hostname, gb.hostname) == (a.id, b.id)
        assert ga.token == a.envd_access_token != gb.token == b.envd_access_token
        assert (ga.env["WHO"], gb.env["WHO"]) == ("a", "b")


async def test_a_rebuilt_template_drops_its_stale_pooled_vms(tmp_path: Path) -> None:
    async with double_node(tmp_path, pool_max=1) as node:
        orc = node.orchestrator
        await orc.create(node.request())
        await eventually(lambda: pool_ready(node, 1))
        [stale] = list(orc.pools)
        await make_template(node.driver, node.slots, node.templates, "base")
        record, template = await orc.create(node.request())
        assert record.id != stale.sandbox_id and record.restored_from == template.snapshot_dir
        assert orc.pools.counters.evictions["base"] == 1
        assert not (node.config.paths.sandboxes / stale.sandbox_id).exists()


async def test_memory_pressure_gives_pooled_vms_back_then_refuses(tmp_path: Path) -> None:
    async with double_node(tmp_path, pool_max=1) as node:
        orc = node.orchestrator
        running, _ = await orc.create(node.request())
        await eventually(lambda: pool_ready(node, 1))
        # A create now needs more memory than any host has available.
        orc.config = node.config.model_copy(update={"admission_sandbox_mb": 1 << 40})
        with pytest.raises(CapacityReached, match="not enough memory"):
            await orc.create(node.request())
        assert orc.pools.counters.evictions["base"] == 1 and list(orc.pools) == []
        assert orc.stats.refused[Refusal.MEMORY] == 1
        assert orc.get(running.id).state is SandboxState.RUNNING  # nothing killed
        assert [r.id for r in orc.list()] == [running.id]


async def test_memory_pressure_alone_gives_pooled_vms_back(tmp_path: Path) -> None:
    async with double_node(tmp_path, pool_max=1) as node:
        orc = node.orchestrator
        running, _ = await orc.create(node.request())
        await eventually(lambda: pool_ready(node, 1))
        orc.config = node.config.model_copy(update={"admission_sandbox_mb": 1 << 40})
        orc.node.pool_wake.set()  # the refill's next look, without a create
        await eventually(lambda: list(orc.pools) == [])
        assert orc.pools.counters.evictions["base"] == 1
        assert orc.stats.refused == {}  # no create was refused: none asked
        assert orc.get(running.id).state is SandboxState.RUNNING


async def test_nominal_memory_past_the_overcommit_limit_is_refused(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        running, _ = await node.orchestrator.create(node.request())
        # Room for less than two 512 MiB guests on any host.
        node.orchestrator.config = node.config.model_copy(
            update={"memory_overcommit": 1000 / node_total_mb()}
        )
        with pytest.raises(CapacityReached, match="overcommit"):
            await node.orchestrator.create(node.request())
        assert node.orchestrator.stats.refused[Refusal.OVERCOMMIT] == 1
        assert node.orchestrator.get(running.id).state is SandboxState.RUNNING


def node_total_mb() -> int:
    return int(psutil.virtual_memory().total >> 20)


def test_pool_targets_follow_the_recent_creates() -> None:
    now = [0.0]
    pools = WarmPools(3, clock=lambda: now[0])
    assert pools.missing() == []  # no creates: no pool
    for _ in range(5):
        pools.note_create("t")
    assert pools.missing() == ["t"] * 3  # bounded by the maximum
    now[0] = warm.WINDOW + 1
    assert pools.missing() == []  # a minute without creates: none wanted
    assert WarmPools(0).enabled is False
