"""The orchestrator's lifecycle on the double driver and slots: real catalog, templates,
repository and envd traffic, no VMs. Races are made deterministic by holding a driver operation
half-way (`driver.hold`) and failures by injecting them (`driver.fail_next`)."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from pathlib import Path

import pytest

from aenv.network import Slot
from aenv.orchestrator.kinds import SaveMode
from aenv.orchestrator.lifecycle import (
    CapacityReached,
    CreateFailed,
    InvalidState,
    OperationFailed,
    SandboxNotFound,
)
from aenv.orchestrator.states import SandboxState
from tests.doubles.node import (
    TEMPLATE_FILES,
    assert_clean,
    double_node,
    resumed_with_a_copy,
)
from tests.doubles.slots import DoubleSlots
from tests.support.wait import eventually


async def test_create_restores_the_template_and_inits_envd(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        record, template = await node.orchestrator.create(node.request(env_vars={"A": "1"}))
        assert record.state is SandboxState.RUNNING and template.template_id == "base"
        guest = node.guest(record.id)
        assert guest.token == record.envd_access_token != template.envd_access_token
        assert guest.hostname == record.id
        assert guest.env == {
            "A": "1",
            "E2B_SANDBOX": "true",
            "E2B_SANDBOX_ID": record.id,
            "E2B_TEMPLATE_ID": "base",
        }
        assert guest.read("/etc/template") == TEMPLATE_FILES["/etc/template"]
        assert record.restored_from == template.snapshot_dir
        assert await node.orchestrator.kill(record.id)
        assert node.catalog.get(record.id) is None
        assert_clean(node)


async def test_failed_create_leaves_nothing(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        node.driver.fail_next("restore")
        with pytest.raises(CreateFailed, match="injected"):
            await node.orchestrator.create(node.request())
        assert node.catalog.list() == []
        assert_clean(node)


async def test_pause_and_resume_keep_the_guest(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        node.guest(record.id).write("/home/user/note", "unflushed")
        paused = await node.orchestrator.pause(record.id)
        assert paused.state is SandboxState.PAUSED
        assert (paused.checkpoint_seq, paused.checkpoint_mode) == (1, SaveMode.FULL)
        assert node.driver.running == {} and node.slots.in_use == {}
        with pytest.raises(InvalidState):
            await node.orchestrator.pause(record.id)
        resumed, changed = await node.orchestrator.resume(record.id, 60)
        assert changed and resumed.state is SandboxState.RUNNING
        guest = node.guest(record.id)
        assert guest.read("/home/user/note") == "unflushed"  # memory came back
        assert guest.token == record.envd_access_token


async def test_filesystem_only_pause_flushes_first_and_cold_boots(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        node.guest(record.id).write("/home/user/note", "written")
        paused = await node.orchestrator.pause(record.id, mode=SaveMode.FILESYSTEM)
        assert paused.checkpoint_mode is SaveMode.FILESYSTEM
        boots = node.driver.calls["boot"]
        await node.orchestrator.resume(record.id, 60)
        assert node.driver.calls["boot"] == boots + 1  # booted from the disks, not restored
        guest = node.guest(record.id)
        assert guest.read("/home/user/note") == "written"  # on disk thanks to /sync
        assert guest.token == record.envd_access_token and guest.inits == 1


async def test_failed_pause_leaves_it_running(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        node.driver.fail_next("snapshot")
        with pytest.raises(OperationFailed):
            await node.orchestrator.pause(record.id)
        current = node.orchestrator.get(record.id)
        assert current.state is SandboxState.RUNNING and current.checkpoint_seq == 0
        assert not (node.config.paths.sandboxes / record.id / "pause-1").exists()
        assert node.guest(record.id).token == record.envd_access_token  # still serving


async def test_failed_resume_goes_back_to_paused(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        node.guest(record.id).write("/data", "kept")
        await node.orchestrator.pause(record.id)
        # Uploaded in the background: wait for the copy the resume falls back to.
        await eventually(lambda: node.row(record.id).archived is not None)
        restores = node.driver.calls["restore"]
        # The local checkpoint fails, then the repository's copy of it.
        node.driver.fail_next("restore", times=2)
        with pytest.raises(OperationFailed, match="resume"):
            await node.orchestrator.resume(record.id, 60)
        assert node.driver.calls["restore"] == restores + 2
        assert node.orchestrator.get(record.id).state is SandboxState.PAUSED
        assert node.driver.running == {} and node.slots.in_use == {}
        await node.orchestrator.resume(record.id, 60)  # the checkpoint is intact
        assert node.guest(record.id).read("/data") == "kept"


async def test_a_resume_right_after_a_pause_falls_back_to_that_pauses_copy(
    tmp_path: Path,
) -> None:
    """The resume stops the upload of the checkpoint it restores (it would share the cores);
    when the local restore then fails, the upload starts again and the fallback restores from
    the copy of that checkpoint, not from the older copy the row still names."""
    async with double_node(tmp_path) as node:
        sandbox_id = await resumed_with_a_copy(node)
        await node.orchestrator.pause(sandbox_id)
        node.driver.fail_next("restore")  # the local checkpoint, at once
        await node.orchestrator.resume(sandbox_id, 60)
        assert node.guest(sandbox_id).read("/data") == "two"
        archived = node.row(sandbox_id).archived
        assert archived is not None and archived.seq == 2


async def test_pause_racing_kill_runs_one_after_the_other(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        held = node.driver.hold("snapshot")
        pause = asyncio.create_task(node.orchestrator.pause(record.id))
        await held.reached.wait()
        kill = asyncio.create_task(node.orchestrator.kill(record.id))
        await asyncio.sleep(0.05)
        assert not kill.done()  # the kill waits for the pause's lock
        assert node.row(record.id).state is SandboxState.PAUSING
        held.release()
        paused = await pause
        assert paused.state is SandboxState.PAUSED
        assert await kill
        assert node.catalog.get(record.id) is None
        with pytest.raises(SandboxNotFound):
            await node.orchestrator.resume(record.id, 60)
        assert_clean(node)


async def test_vmm_crash_removes_the_sandbox(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        vm = node.driver.running[node.orchestrator.guest_endpoint(record.id).incarnation]
        await vm.crash()
        await eventually(lambda: node.catalog.get(record.id) is None)
        assert_clean(node)


async def test_admission_queue_and_capacity(tmp_path: Path) -> None:
    async with double_node(tmp_path, max_concurrent_creates=1, max_sandboxes=2) as node:
        held = node.driver.hold("restore")
        first = asyncio.create_task(node.orchestrator.create(node.request()))
        await held.reached.wait()
        second = asyncio.create_task(node.orchestrator.create(node.request()))
        # It waits for the first, and does not fail. Its checks before the queue run in
        # threads: a fixed pause here ended before them on a loaded host.
        await eventually(lambda: node.orchestrator.stats.queued == 1, "the second create queued")
        assert node.driver.calls["restore"] == 1
        with pytest.raises(CapacityReached):  # two held (one running, one queued)
            await node.orchestrator.create(node.request())
        held.release()
        (a, _), (b, _) = await first, await second
        assert {a.state, b.state} == {SandboxState.RUNNING}
        assert node.orchestrator.stats.succeeded == 2 and node.orchestrator.stats.queued == 0
        await node.orchestrator.kill(a.id)
        await node.orchestrator.create(node.request())  # room again


async def test_creates_racing_for_the_last_place_win_it_once(tmp_path: Path) -> None:
    # The checks before joining the queue await (host reserve, memory): creates started
    # together must still see each other, for the node's cap and for a team's.
    async with double_node(tmp_path, max_sandboxes=3, team_max_sandboxes=2) as node:
        orc = node.orchestrator
        await orc.create(node.request())
        # Each of its own team: only the node's cap applies.
        racing = [orc.create(node.request(team_id=f"team-{i}")) for i in range(4)]
        results = await asyncio.gather(*racing, return_exceptions=True)
        assert sum(isinstance(r, CapacityReached) for r in results) == 2
        assert len(orc.list()) == 3
        for record in orc.list():
            await orc.kill(record.id)
        results = await asyncio.gather(
            *(orc.create(node.request(team_id="key-a")) for _ in range(3)), return_exceptions=True
        )
        assert sum(isinstance(r, CapacityReached) for r in results) == 1
        for record in orc.list():
            await orc.kill(record.id)
        assert_clean(node)


async def test_expiry_auto_pauses(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        request = node.request(auto_pause=True, auto_pause_mode=SaveMode.FILESYSTEM)
        record, _ = await node.orchestrator.create(request)
        killed, _ = await node.orchestrator.create(node.request())
        node.orchestrator.set_timeout(record.id, 0)
        node.orchestrator.set_timeout(killed.id, 0)
        await eventually(lambda: node.orchestrator.is_paused(record.id))
        current = node.orchestrator.get(record.id)
        assert current.state is SandboxState.PAUSED
        assert current.checkpoint_mode is SaveMode.FILESYSTEM  # what autoPause asked for
        await eventually(lambda: node.catalog.get(killed.id) is None)  # no autoPause: killed


async def test_every_stop_of_a_vm_is_announced(tmp_path: Path) -> None:
    # The proxy listens: it ends the connections to a VM the moment it stops.
    async with double_node(tmp_path) as node:
        stopped: list[tuple[str, str]] = []
        node.orchestrator.vm_stopped.append(lambda *run: stopped.append(run))
        record, _ = await node.orchestrator.create(node.request())
        first = node.orchestrator.guest_endpoint(record.id).incarnation
        await node.orchestrator.pause(record.id)
        await node.orchestrator.resume(record.id, 60)
        second = node.orchestrator.guest_endpoint(record.id).incarnation
        await node.orchestrator.kill(record.id)
        assert stopped == [(record.id, first), (record.id, second)]
        assert_clean(node)


async def test_a_team_runs_at_most_team_max_sandboxes(tmp_path: Path) -> None:
    async with double_node(tmp_path, team_max_sandboxes=2) as node:
        orc = node.orchestrator
        first, _ = await orc.create(node.request(team_id="key-a"))
        await orc.create(node.request(team_id="key-a"))
        with pytest.raises(CapacityReached, match="for this team"):
            await orc.create(node.request(team_id="key-a"))
        other, _ = await orc.create(node.request(team_id="key-b"))  # another key's own count
        await orc.pause(first.id)  # paused sandboxes do not count
        third, _ = await orc.create(node.request(team_id="key-a"))
        assert node.row(third.id).team_id == "key-a"
        children = await orc.fork(other.id, 3, 60, team_id="key-a")
        assert sum(isinstance(c, CapacityReached) for c in children) == 3
        for record in orc.list():
            await orc.kill(record.id)
        assert_clean(node)


async def test_a_host_under_its_reserve_refuses_creates_and_saves(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        # A reserve no host has: the node measures its own disk and memory against it.
        for reserve in ({"reserve_disk_mb": 1 << 40}, {"reserve_memory_mb": 1 << 40}):
            node.orchestrator.config = node.config.model_copy(update=reserve)
            with pytest.raises(CapacityReached, match="under its reserve"):
                await node.orchestrator.create(node.request())
            with pytest.raises(OperationFailed, match="under its reserve"):
                await node.orchestrator.pause(record.id)
            with pytest.raises(OperationFailed, match="under its reserve"):
                await node.orchestrator.snapshot(record.id, name="full")
            assert node.row(record.id).state is SandboxState.RUNNING  # left as it was
            assert [r.id for r in node.catalog.list()] == [record.id]
        await node.orchestrator.kill(record.id)
        assert_clean(node)


class ReclaimingSlots(DoubleSlots):
    """Double slots that reclaim as the real pool does once a slot's acquiring task has ended:
    every slot handed out that the holder does not keep is destroyed. A second release of a
    slot fails, as it does in the real pool (whose index may have been handed out again)."""

    async def reclaim_leaked(self, kept: Collection[Slot]) -> list[str]:
        keep = {slot.netns for slot in kept}
        leaked = [slot for netns, slot in self.in_use.items() if netns not in keep]
        for slot in leaked:
            await self.release(slot)
        return [slot.netns for slot in leaked]

    async def release(self, slot: Slot) -> None:
        if slot.netns not in self.in_use:
            raise ValueError(f"slot {slot.netns} released twice")
        await super().release(slot)


async def test_reconcile_leaves_the_slot_of_a_vm_being_stopped(tmp_path: Path) -> None:
    # A kill takes the sandbox out of the live VMs and then stops its VMM (which can take a
    # while); a reconciliation in between once released its slot as leaked, and the kill's own
    # release then failed (a 500 for the DELETE).
    async with double_node(tmp_path, slots=ReclaimingSlots()) as node:
        record, _ = await node.orchestrator.create(node.request())
        held = node.driver.hold("stop")
        kill = asyncio.create_task(node.orchestrator.kill(record.id))
        await held.reached.wait()
        await node.orchestrator.reconcile()
        assert len(node.slots.in_use) == 1  # still the stopping VM's
        held.release()
        assert await kill
        assert_clean(node)


async def test_reconcile_stops_a_vm_whose_sandbox_is_gone(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        stopped: list[tuple[str, str]] = []
        node.orchestrator.vm_stopped.append(lambda *run: stopped.append(run))
        kept, _ = await node.orchestrator.create(node.request())
        lost, _ = await node.orchestrator.create(node.request())
        lost_vm = node.orchestrator.guest_endpoint(lost.id).incarnation
        node.catalog.delete(lost.id)  # its row went away without its VM (a bug, a crash)
        await node.orchestrator.reconcile()
        assert stopped == [(lost.id, lost_vm)]
        assert list(node.driver.running) == [node.orchestrator.guest_endpoint(kept.id).incarnation]
        assert len(node.slots.in_use) == 1
        await node.orchestrator.kill(kept.id)
        assert_clean(node)  # the lost one's files went too
