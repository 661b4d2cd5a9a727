"""Idle hibernation's lifecycle on the double driver and slots: an idle sandbox is saved and
stopped but runs for the API, its next request wakes it as it was, a running command or an open
exchange keeps it awake (so does a volume in use), and a hibernated sandbox can be paused,
killed or time out. The looks for idle sandboxes are taken by the test (`hibernate_idle`),
with a tiny `after`. The real VMs and the proxy's view of the traffic are in
tests/e2e/restart/test_hibernation.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from aenv.orchestrator.catalog import VolumeMount
from aenv.orchestrator.kinds import SaveMode
from aenv.orchestrator.states import SandboxState
from tests.doubles.node import DoubleNode, assert_clean, double_node
from tests.support.wait import eventually

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
        assert record.id in orc.node.timers  # its timeout still counts

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


async def test_volumes_are_released_to_hibernate_unless_one_is_in_use(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        enable(node)
        orc = node.orchestrator
        volume = await orc.volumes.create("data")
        mounts = (VolumeMount(volume.id, "/data"),)
        busy, _ = await orc.create(node.request(volume_mounts=mounts))
        node.guest(busy.id).volumes_busy = True
        time.sleep(AFTER)
        await orc.hibernate_idle()
        # Its save would keep only the filesystem: it runs on, its volume mounted.
        assert node.row(busy.id).state is SandboxState.RUNNING
        assert node.guest(busy.id).volumes_mounted
        node.guest(busy.id).volumes_busy = False
        await hibernated(node, busy.id)
        assert node.row(busy.id).checkpoint_mode is SaveMode.FULL
        await orc.endpoint_for_traffic(busy.id)
        assert node.guest(busy.id).volumes_mounted  # mounted again at the wake's `/init`
        assert await orc.kill(busy.id)


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
        assert paused.id not in orc.node.timers  # paused for good: no timeout
        resumed, was_resumed = await orc.resume(paused.id, 60)
        assert was_resumed and resumed.state is SandboxState.RUNNING
        assert node.guest(paused.id).read("/home/user/note") == "kept"

        orc.set_timeout(ends.id, 0)
        await eventually(lambda: node.catalog.get(ends.id) is None)

        assert await orc.kill(killed.id)
        assert await orc.kill(paused.id)
        assert_clean(node)


async def test_shutdown_during_a_hibernation_or_pause_keeps_the_sandbox_paused(
    tmp_path: Path,
) -> None:
    """A graceful shutdown while a hibernation and a user's pause are saving waits for them: the
    user's pause stays paused (pause-on-shutdown on or off), the hibernated sandbox is paused
    like a running one (or killed like one when pause-on-shutdown is off)."""
    for pause_on_shutdown in (True, False):
        async with double_node(
            tmp_path / str(pause_on_shutdown), pause_on_shutdown=pause_on_shutdown
        ) as node:
            enable(node)
            orc = node.orchestrator
            first, _ = await orc.create(node.request())
            second, _ = await orc.create(node.request())
            for record in (first, second):
                node.guest(record.id).write("/home/user/note", record.id)
            time.sleep(AFTER)
            held = node.driver.hold("snapshot")
            hibernating = asyncio.create_task(orc.hibernate_idle())
            await held.reached.wait()
            # The look hibernates one at a time: the other is paused by its user meanwhile.
            dozing, pausing = sorted(
                (first, second), key=lambda r: node.row(r.id).state is not SandboxState.PAUSING
            )
            assert node.row(dozing.id).state is SandboxState.PAUSING
            user_pause = asyncio.create_task(orc.pause(pausing.id))
            closing = asyncio.create_task(orc.close())
            await asyncio.sleep(0.05)
            held.release()
            await asyncio.gather(hibernating, user_pause, closing)
            assert node.row(pausing.id).state is SandboxState.PAUSED
            kept = [pausing]
            if pause_on_shutdown:
                assert node.row(dozing.id).state is SandboxState.PAUSED
                kept.append(dozing)
            else:  # hibernated is running for the API: killed like the running ones
                assert node.catalog.get(dozing.id) is None

            restarted = node.reopen()
            await restarted.orchestrator.start()
            for record in kept:
                resumed, _ = await restarted.orchestrator.resume(record.id, 60)
                assert resumed.state is SandboxState.RUNNING
                assert restarted.guest(record.id).read("/home/user/note") == record.id
                assert await restarted.orchestrator.kill(record.id)
            await restarted.orchestrator.close()
