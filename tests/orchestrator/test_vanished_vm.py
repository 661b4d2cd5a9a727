"""A sandbox whose row says running while its VM is gone (it vanished between two reconcile
passes): pause, snapshot, fork and a graceful shutdown answer as for a sandbox whose VMM exited
(not found, the others untouched) and the sandbox is removed, instead of a KeyError."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.orchestrator.lifecycle import SandboxNotFound
from aenv.orchestrator.states import SandboxState
from tests.doubles.node import DoubleNode, assert_clean, double_node
from tests.support.wait import eventually


async def _vanish(node: DoubleNode, sandbox_id: str) -> None:
    """What a VM that disappeared without its watcher noticing leaves: a running row, its files,
    no VM and no slot. The orchestrator's private map is the only way to reach that state."""
    live = node.orchestrator.node.live.pop(sandbox_id)
    await live.vm.stop()
    await node.slots.release(live.slot)


async def _removed(node: DoubleNode, sandbox_id: str) -> None:
    """Waits for the removal the operation started in the background."""
    await eventually(lambda: node.catalog.get(sandbox_id) is None, f"{sandbox_id} removed")


async def test_operations_on_a_vanished_vm_answer_not_found_and_remove_it(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        orchestrator = node.orchestrator
        for operation in (
            lambda i: orchestrator.pause(i),
            lambda i: orchestrator.snapshot(i),
            lambda i: orchestrator.fork(i, 1, 60),
        ):
            record, _ = await orchestrator.create(node.request())
            await _vanish(node, record.id)
            with pytest.raises(SandboxNotFound):
                await operation(record.id)
            await _removed(node, record.id)
            assert_clean(node)


async def test_shutdown_with_a_vanished_vm_parks_the_others(tmp_path: Path) -> None:
    async with double_node(tmp_path, pause_on_shutdown=True) as node:
        gone, _ = await node.orchestrator.create(node.request())
        kept, _ = await node.orchestrator.create(node.request())
        await _vanish(node, gone.id)
        await node.orchestrator.close()
        assert node.catalog.get(gone.id) is None
        assert node.row(kept.id).state is SandboxState.PAUSED
        assert node.driver.running == {} and node.slots.in_use == {}
