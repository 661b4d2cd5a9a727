"""Reset in place: a running sandbox returns to a snapshot's (or a template's) state, keeping
its id, token, traffic token, network rules, metadata and timeout: the episode reset of an RL
loop, without a create and a kill (and without a new id for the client to learn).

The new VM is started before the old one stops, so a reset that fails changes nothing:

1. Find the saved state (a snapshot or template a create could start from) and pin its
   directory; wake a hibernated sandbox (it is reset from running).
2. Under the sandbox's lock: it must be running; the host must have the reserve and the
   memory for a second VM while both exist.
3. Launch the new VM from the saved state in the sandbox's directories, on a slot of its
   own with the sandbox's egress; envd's `/init` gives it the sandbox's token, env and
   hostname (`launch`). The old VM serves on meanwhile. On failure nothing of the new VM is
   left, and the sandbox is as it was.
4. The row now names the saved state it was restored from (and its template and sizes); the
   old VM is stopped (its listeners told: the proxy ends its connections), its slot
   released; the new VM's timeout, idle clock and VMM watch start. An `updated` event
   names the saved state.
5. Collect saved states nothing uses any more (the state the sandbox came from before, when
   it was another).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from aenv.orchestrator import capacity, ending, restore
from aenv.orchestrator.catalog import SandboxRecord
from aenv.orchestrator.errors import CapacityReached, InvalidState, OperationFailed
from aenv.orchestrator.events import EventType
from aenv.orchestrator.kinds import SaveMode, TemplateKind
from aenv.orchestrator.launch import launch
from aenv.orchestrator.node import FAILURES, Node
from aenv.orchestrator.states import SandboxState
from aenv.orchestrator.templates import Template, TemplateNotFound
from aenv.timing import Steps

log = logging.getLogger("aenv.orchestrator")

# What a sandbox may be reset to: what users start sandboxes from. Fork checkpoints, build
# layers and image bases are the node's own.
RESETTABLE = frozenset({TemplateKind.SNAPSHOT, TemplateKind.TEMPLATE})


async def reset(node: Node, sandbox_id: str, source: str) -> SandboxRecord:
    """Return running sandbox `sandbox_id` to the state of snapshot or template `source` (an
    id or name). Raises `SandboxNotFound`, `TemplateNotFound` (no such saved state, or one of
    another kind), `InvalidState` (not running), `CapacityReached` (no memory for the new VM
    beside the old) or `OperationFailed`; in every case the sandbox runs on as it was."""
    base = node.templates.get(source)
    if base.kind not in RESETTABLE:
        raise TemplateNotFound(source)
    await restore.wake(node, sandbox_id)
    with node.saved.pin(Path(base.snapshot_dir)):
        before = node.get(sandbox_id).restored_from
        record = await _reset_locked(node, sandbox_id, base)
    if before != record.restored_from:  # an episode's reset to the same state frees nothing
        await node.saved.collect()
    return record


async def _reset_locked(node: Node, sandbox_id: str, base: Template) -> SandboxRecord:
    """Steps 2-4."""
    async with node.lock(sandbox_id):
        record = node.get(sandbox_id)
        if record.state is not SandboxState.RUNNING:
            raise InvalidState(sandbox_id, record.state, "reset", "only a running one resets")
        old = node.live_of(sandbox_id)
        await capacity.check_reserve(node, f"reset sandbox {sandbox_id}")
        refused = await capacity.memory_refusal(node, base.memory_mb)
        if refused is not None:
            raise CapacityReached(f"no room to reset {sandbox_id}: {refused[1]}")
        steps = Steps()
        target = dataclasses.replace(
            record,
            template_id=base.template_id,
            alias=base.aliases[0] if base.aliases else None,
            cpu_count=base.cpu_count,
            memory_mb=base.memory_mb,
            disk_size_mb=base.disk_size_mb,
            restored_from=base.snapshot_dir,
        )
        try:
            snapshot = await node.saved.base_snapshot(base)
            if (served := node.saved.served_template(base)) is not None:
                node.saved.lazy.share(sandbox_id, served)  # its saves wait for the files
            new = await launch(
                node,
                target,
                snapshot,
                current_token=base.envd_access_token,
                cold=base.save_mode is SaveMode.FILESYSTEM,
            )
        except FAILURES as e:
            raise OperationFailed(f"reset of sandbox {sandbox_id} failed: {e}") from e
        steps.mark("launch")
        updated = node.catalog.update(
            sandbox_id,
            template_id=target.template_id,
            alias=target.alias,
            cpu_count=target.cpu_count,
            memory_mb=target.memory_mb,
            disk_size_mb=target.disk_size_mb,
            restored_from=target.restored_from,
        )
        assert updated is not None  # only this task changes a row it holds the lock of
        node.events.record(EventType.UPDATED, updated, {"reset": base.template_id})
        await node.stop(sandbox_id, old)
        steps.mark("old VM stopped")
        ending.started(node, updated, new)
        log.info("reset of sandbox %s to %s: %s", sandbox_id, base.template_id, steps)
        return updated
