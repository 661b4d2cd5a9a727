"""Starting a saved sandbox again from its newest checkpoint: resume (a paused one), connect
(E2B's resume-or-extend), wake (a hibernated one), and the proxy's lookup that does either
when traffic comes.

1. PAUSED -> RESUMING (HIBERNATED -> WAKING); stop the detach of its last pause, whose VMM
   would compete with this restore for the CPU.
2. Merge a deep chain of memory layers into one state first (`merged`).
3. Launch the VM from the checkpoint (`launch`); when the local checkpoint turns out
   unusable, from the repository's copy. On failure the sandbox is left saved as it was.
4. RESUMING -> RUNNING with its new end (a wake keeps its timeout); its timeout, idle clock
   and VMM watch start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aenv.orchestrator import checkpoints, detach, ending
from aenv.orchestrator.catalog import SandboxRecord
from aenv.orchestrator.errors import InvalidState, OperationFailed
from aenv.orchestrator.events import EventType
from aenv.orchestrator.kinds import SaveMode
from aenv.orchestrator.launch import launch
from aenv.orchestrator.node import FAILURES, Live, Node
from aenv.orchestrator.queries import GuestEndpoint, guest_endpoint
from aenv.orchestrator.states import ASLEEP, SandboxState
from aenv.runtime.driver import RestoreError, Snapshot
from aenv.timing import Steps

log = logging.getLogger("aenv.orchestrator")


async def resume(
    node: Node, sandbox_id: str, timeout: int, *, mode: SaveMode = SaveMode.FULL
) -> tuple[SandboxRecord, bool]:
    """Start a paused sandbox again from its newest checkpoint (cold-booted from its disks
    when `mode` is FILESYSTEM or it was paused filesystem-only). Returns the record and
    whether it was resumed (False: it was running already; nothing changed)."""
    async with node.lock(sandbox_id):
        record = node.get(sandbox_id)
        if record.state.public == "running":
            return record, False
        if record.state is not SandboxState.PAUSED:
            raise InvalidState(sandbox_id, record.state, "resume")
        resuming = node.catalog.transition(sandbox_id, [SandboxState.PAUSED], SandboxState.RESUMING)
        assert resuming is not None
        steps = Steps()
        await node.settling.cancel(sandbox_id)  # the upload still starts
        steps.mark("settling")
        cold = SaveMode.FILESYSTEM in (mode, record.checkpoint_mode)
        try:
            live = await _launch_checkpoint(node, resuming, cold)
        except FAILURES as e:
            node.catalog.transition(sandbox_id, [SandboxState.RESUMING], SandboxState.PAUSED)
            raise OperationFailed(f"resume of sandbox {sandbox_id} failed: {e}") from e
        steps.mark("launch")
        log.info("resume of sandbox %s: %s", sandbox_id, steps)
        running = node.catalog.transition(
            sandbox_id,
            [SandboxState.RESUMING],
            SandboxState.RUNNING,
            end_at=time.time() + timeout,
        )
        assert running is not None
        ending.started(node, running, live)
        node.events.record(EventType.RESUMED, running)
        return running, True


async def connect(
    node: Node, sandbox_id: str, timeout: int, *, mode: SaveMode = SaveMode.FULL
) -> tuple[SandboxRecord, bool]:
    """E2B `connect`: a running sandbox's timeout only grows; a paused one is resumed."""
    record, resumed = await resume(node, sandbox_id, timeout, mode=mode)
    if not resumed:
        record = ending.extend_timeout(node, sandbox_id, timeout)
    return record, resumed


async def wake(node: Node, sandbox_id: str) -> None:
    """Restore a hibernated sandbox from its checkpoint, its timeout as it was. Raises
    `OperationFailed` when that fails (it stays hibernated)."""
    async with node.lock(sandbox_id):
        record = node.catalog.get(sandbox_id)
        if record is None or record.state is not SandboxState.HIBERNATED:
            return
        waking = node.catalog.transition(sandbox_id, [SandboxState.HIBERNATED], SandboxState.WAKING)
        assert waking is not None
        cold = waking.checkpoint_mode is SaveMode.FILESYSTEM
        try:
            live = await _launch_checkpoint(node, waking, cold)
        except FAILURES as e:
            node.catalog.transition(sandbox_id, [SandboxState.WAKING], SandboxState.HIBERNATED)
            raise OperationFailed(f"wake of sandbox {sandbox_id} failed: {e}") from e
        running = node.catalog.transition(sandbox_id, [SandboxState.WAKING], SandboxState.RUNNING)
        assert running is not None
        ending.started(node, running, live)


async def endpoint_for_traffic(node: Node, sandbox_id: str) -> GuestEndpoint:
    """The proxy's lookup: a paused sandbox that asked for `autoResume` is resumed first,
    a hibernated one woken."""
    node.hibernation.awake(sandbox_id)  # before any await: a hibernation checks it last
    record = node.catalog.get(sandbox_id)
    if record is not None and record.state is SandboxState.PAUSING:
        async with node.lock(sandbox_id):  # a pause or hibernation under way: its end
            record = node.catalog.get(sandbox_id)
    if record is not None and record.auto_resume and record.state.public == "paused":
        with contextlib.suppress(InvalidState):
            await resume(node, sandbox_id, record.timeout)
    elif record is not None and record.state in ASLEEP:
        await wake(node, sandbox_id)
    return guest_endpoint(node, sandbox_id)


async def _launch_checkpoint(node: Node, record: SandboxRecord, cold: bool) -> Live:
    """Steps 2-3: start a saved sandbox from its newest checkpoint; when the local one turns
    out unusable (a layer below it lost), from the repository's copy."""
    token = record.envd_access_token
    snapshot = await node.saved.paused_checkpoint(record)
    try:
        async with node.saved.push_held(record, snapshot):
            snapshot = await _merged(node, record, snapshot)
            return await _launch_served(node, record, snapshot, token, cold)
    except RestoreError:
        if node.saved.archive is None:
            raise
    snapshot = await node.saved.paused_checkpoint(record, pull=True)
    return await _launch_served(node, record, snapshot, token, cold)


async def _launch_served(
    node: Node, record: SandboxRecord, snapshot: Snapshot, token: str | None, cold: bool
) -> Live:
    """`launch`, the checkpoint's lazily served files (if any: `SavedStates.lazy`) kept
    beside the VM from then on, or ended when it does not start."""
    try:
        live = await launch(node, record, snapshot, current_token=token, cold=cold)
    except BaseException:
        await node.saved.lazy.end(record.id)
        raise
    node.spawn(node.saved.lazy.beside(record.id, live.vm))
    return live


async def _merged(node: Node, record: SandboxRecord, snapshot: Snapshot) -> Snapshot:
    """The sandbox's local checkpoint with a chain of memory layers `MERGE_DEPTH` deep
    merged into one state first (`Detacher.merge`, adopted at once): the restore would
    compose the chain all the same, and the sandbox then lies over that one state, so
    its next pauses stay small layers. Without this, a sandbox resumed right after each
    pause (which stops the background merge) reached the chain's cap every few pauses,
    where a save writes all it changed since its base. The layered form when the merge
    fails, or for a copy pulled from the repository."""
    if len(snapshot.layers) < detach.MERGE_DEPTH:
        return snapshot
    directory = checkpoints.pause_dir(node.dirs(record.id)[0], record.checkpoint_seq)
    if snapshot.state_file.parent != directory:  # a copy pulled from the repository
        return snapshot
    merged = await node.detacher.merge(snapshot, directory)
    if merged is None:
        return snapshot
    await asyncio.to_thread(detach.adopt, directory, merged)
    return merged
