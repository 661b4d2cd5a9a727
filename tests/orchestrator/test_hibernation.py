"""Idle hibernation's lifecycle on the double driver and slots: an idle sandbox is saved and
stopped but runs for the API, its next request wakes it as it was, a running command or an open
exchange keeps it awake, and a hibernated sandbox can be paused, killed or time out. The looks
for idle sandboxes are taken by the test (`hibernate_idle`), with a tiny `after`. The real VMs
and the proxy's view of the traffic are in tests/e2e/restart/test_hibernation.py."""

from __future__ import annotations

import time
from pathlib import Path

from aenv.orchestrator.states import SandboxState
from tests.doubles.node import DoubleNode, assert_clean, double_node, eventually

AFTER = 0.001


class OpenExchange:
    """A data plane with an exchange open to every sandbox."""

    def quiet_since(self, sandbox_id: str) -> float | None:
        return None


def enable(node: DoubleNode) -> None:
    """Hibernation on with a tiny `after`, and no background looks (the node's config has it
    off): the test takes them."""
    node.orchestrator.hibernation.after = AFTER


async def hibernated(node: DoubleNode, sandbox_id: str) -> None:
    time.sleep(AFTER)  # the idle clock of a sandbox just created passes `after`
    await node.orchestrator.hibernate_idle()
    assert node.row(sandbox_id).state is SandboxState.HIBERNATED


async def test_idle_sandbox_hibernates_and_its_next_request_wakes_it(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        enable(node)
        orc = node.orchestrator
        record, _ = await orc.create(node.request())
        node.guest(record.id).write("/home/user/note", "in memory")
        await hibernated(node, record.id)
        assert node.driver.running == {}  # no VM
        assert orc.get(record.id).state.public == "running"
        assert [r.id for r in orc.list()] == [record.id]
        assert record.id in orc._timers  # its timeout still counts

        endpoint = await orc.endpoint_for_traffic(record.id)
        assert endpoint.record.state is SandboxState.RUNNING
        assert endpoint.record.end_at == record.end_at  # a wake does not move the timeout
        assert node.guest(record.id).read("/home/user/note") == "in memory"
        assert await orc.kill(record.id)
        assert_clean(node)


async def test_a_running_command_or_open_exchange_keeps_it_awake(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        enable(node)
        orc = node.orchestrator
        busy, _ = await orc.create(node.request())
        node.guest(busy.id).running.append(42)
        time.sleep(AFTER)
        await orc.hibernate_idle()
        assert node.row(busy.id).state is SandboxState.RUNNING

        node.guest(busy.id).running.clear()
        orc.hibernation.traffic = OpenExchange()
        time.sleep(AFTER)
        await orc.hibernate_idle()
        assert node.row(busy.id).state is SandboxState.RUNNING
        orc.hibernation.traffic = None
        await hibernated(node, busy.id)


async def test_hibernated_sandbox_pauses_for_good_times_out_and_is_killed(
    tmp_path: Path,
) -> None:
    async with double_node(tmp_path) as node:
        enable(node)
        orc = node.orchestrator
        paused, _ = await orc.create(node.request())
        ends, _ = await orc.create(node.request())
        killed, _ = await orc.create(node.request())
        node.guest(paused.id).write("/home/user/note", "kept")
        for record in (paused, ends, killed):
            await hibernated(node, record.id)

        assert (await orc.pause(paused.id)).state is SandboxState.PAUSED
        assert paused.id not in orc._timers  # paused for good: no timeout
        resumed, was_resumed = await orc.resume(paused.id, 60)
        assert was_resumed and resumed.state is SandboxState.RUNNING
        assert node.guest(paused.id).read("/home/user/note") == "kept"

        orc.set_timeout(ends.id, 0)
        await eventually(lambda: node.catalog.get(ends.id) is None)

        assert await orc.kill(killed.id)
        assert await orc.kill(paused.id)
        assert_clean(node)
