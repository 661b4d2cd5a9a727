"""Reset in place on the double driver: a running sandbox returns to a snapshot's state keeping
its id and tokens, and a reset that fails or is refused leaves it running as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.orchestrator.lifecycle import InvalidState, OperationFailed, SandboxNotFound
from aenv.orchestrator.states import SandboxState
from aenv.orchestrator.templates import TemplateNotFound
from tests.doubles.node import DoubleNode, assert_clean, double_node
from tests.support.wait import eventually


async def _snapshotted(node: DoubleNode) -> tuple[str, str]:
    """A sandbox with `/data` "before" in its snapshot `episode` and "after" since; the ids
    of both."""
    record, _ = await node.orchestrator.create(node.request(metadata={"run": "1"}))
    node.guest(record.id).write("/data", "before")
    snap = await node.orchestrator.snapshot(record.id, name="episode")
    node.guest(record.id).write("/data", "after")
    node.guest(record.id).write("/late", "written after the snapshot")
    return record.id, snap.template_id


async def test_reset_returns_to_the_snapshot_keeping_id_and_tokens(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        sandbox_id, snapshot_id = await _snapshotted(node)
        before = node.row(sandbox_id)
        old_vm = node.vm(sandbox_id)
        reset = await node.orchestrator.reset(sandbox_id, "episode")
        assert reset.id == sandbox_id and reset.state is SandboxState.RUNNING
        assert reset.envd_access_token == before.envd_access_token
        assert reset.traffic_access_token == before.traffic_access_token
        assert (reset.metadata, reset.end_at) == (before.metadata, before.end_at)
        assert reset.template_id == snapshot_id
        assert reset.restored_from == node.templates.get(snapshot_id).snapshot_dir
        guest = node.guest(sandbox_id)
        assert guest.read("/data") == "before" and guest.read("/late") is None
        assert guest.token == before.envd_access_token and guest.hostname == sandbox_id
        assert guest.env["E2B_SANDBOX_ID"] == sandbox_id
        # One VM and one slot: the old VM stopped as planned, not as a crash.
        assert node.vm(sandbox_id) is not old_vm and len(node.driver.running) == 1
        assert len(node.slots.in_use) == 1
        # Episodes repeat: a second reset from the same state.
        guest.write("/data", "episode 2")
        await node.orchestrator.reset(sandbox_id, snapshot_id)
        assert node.guest(sandbox_id).read("/data") == "before"
        assert node.orchestrator.get(sandbox_id).state is SandboxState.RUNNING
        assert await node.orchestrator.kill(sandbox_id)
        assert_clean(node)


async def test_a_failed_reset_leaves_the_sandbox_running_as_it_was(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        sandbox_id, _ = await _snapshotted(node)
        before = node.row(sandbox_id)
        vm = node.vm(sandbox_id)
        node.driver.fail_next("restore")
        with pytest.raises(OperationFailed, match="reset"):
            await node.orchestrator.reset(sandbox_id, "episode")
        assert node.row(sandbox_id) == before
        assert node.vm(sandbox_id) is vm and node.guest(sandbox_id).read("/data") == "after"
        assert len(node.driver.running) == 1 and len(node.slots.in_use) == 1


async def test_a_snapshot_in_use_by_a_reset_sandbox_outlives_its_deletion(
    tmp_path: Path,
) -> None:
    async with double_node(tmp_path) as node:
        sandbox_id, snapshot_id = await _snapshotted(node)
        await node.orchestrator.reset(sandbox_id, snapshot_id)
        directory = Path(node.templates.get(snapshot_id).snapshot_dir)
        await node.orchestrator.delete_template(snapshot_id)
        assert directory.exists()  # the sandbox's disks stack on it
        assert await node.orchestrator.kill(sandbox_id)
        # Gone with the kill, or, when the snapshot's upload to the repository is still
        # under way (it pins its staging copy beside the files), when that upload ends.
        await eventually(lambda: not directory.exists(), "the deleted snapshot's files went")


async def test_refused_resets_change_nothing(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        sandbox_id, _ = await _snapshotted(node)
        with pytest.raises(TemplateNotFound):
            await node.orchestrator.reset(sandbox_id, "no-such-snapshot")
        with pytest.raises(SandboxNotFound):
            await node.orchestrator.reset("nosuchsandbox0000000", "episode")
        await node.orchestrator.pause(sandbox_id)
        with pytest.raises(InvalidState, match="only a running one resets"):
            await node.orchestrator.reset(sandbox_id, "episode")
        assert node.orchestrator.get(sandbox_id).state is SandboxState.PAUSED


async def test_a_sandbox_paused_and_resumed_before_resets(tmp_path: Path) -> None:
    """Its disks stacked on its pause checkpoints; after the reset they stack on the
    snapshot's, and its next pause and resume work as before."""
    async with double_node(tmp_path) as node:
        sandbox_id, _ = await _snapshotted(node)
        await node.orchestrator.pause(sandbox_id)
        await node.orchestrator.resume(sandbox_id, 60)
        await node.orchestrator.reset(sandbox_id, "episode")
        node.guest(sandbox_id).write("/data", "kept over a pause")
        await node.orchestrator.pause(sandbox_id)
        await node.orchestrator.resume(sandbox_id, 60)
        assert node.guest(sandbox_id).read("/data") == "kept over a pause"
        assert node.guest(sandbox_id).read("/late") is None
