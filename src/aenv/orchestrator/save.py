"""Pausing a sandbox: its state saved as a pause checkpoint in its own directory and its VM
stopped, until a resume (or, hibernated, a wake) starts it again.

1. Check the guest answers (with `require_healthy`; else it is left running).
2. RUNNING -> PAUSING; for a FILESYSTEM save, have the guest flush its page cache.
3. The driver saves checkpoint `pause-<seq>` (what the mode says) and stops the VM.
   On failure the checkpoint is removed and the sandbox runs on (PAUSING -> RUNNING).
4. Free the slot; PAUSING -> PAUSED with the new `checkpoint_seq` and `checkpoint_mode`.
5. Prune older checkpoints; detach and upload this one in the background (`settle`).

A sandbox with volumes has its guest unmount them first (`volumes_released`); when one is in
use, only its filesystem is saved. A hibernated sandbox is saved already: its checkpoint
becomes the pause's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aenv.orchestrator import capacity, checkpoints, detach
from aenv.orchestrator.catalog import SandboxRecord
from aenv.orchestrator.envd_client import EnvdClient, EnvdUnavailable
from aenv.orchestrator.errors import (
    GuestUnhealthy,
    InvalidState,
    OperationFailed,
    VolumeInUse,
)
from aenv.orchestrator.events import EventType
from aenv.orchestrator.kinds import SaveMode
from aenv.orchestrator.node import FAILURES, Live, Node, remove_tree
from aenv.orchestrator.states import SandboxState
from aenv.orchestrator.volumes import guest_mounts
from aenv.runtime.driver import Snapshot, SnapshotTarget

log = logging.getLogger("aenv.orchestrator")


async def pause(
    node: Node, sandbox_id: str, *, mode: SaveMode = SaveMode.FULL, require_healthy: bool = False
) -> SandboxRecord:
    """Save the sandbox and stop it; it stays, paused, until resumed or killed."""
    async with node.lock(sandbox_id):
        record = node.get(sandbox_id)
        if record.state is SandboxState.HIBERNATED:
            return await _pause_hibernated(node, record)
        if record.state is not SandboxState.RUNNING:
            raise InvalidState(sandbox_id, record.state, "pause")
        await capacity.check_reserve(node, f"pause sandbox {sandbox_id}")
        if require_healthy:
            try:
                await node.envd_of(record).wait_healthy(5.0)
            except EnvdUnavailable as e:
                raise GuestUnhealthy(f"sandbox {sandbox_id}: envd is not answering") from e
        return await pause_locked(node, record, mode, SandboxState.PAUSED)


async def pause_locked(
    node: Node, record: SandboxRecord, mode: SaveMode, to: SandboxState
) -> SandboxRecord:
    """Steps 2-5 (the caller holds the lock, the sandbox runs), ending in `to`: PAUSED, or
    HIBERNATED, whose timeout keeps running and whose checkpoint stays local (it is detached
    and uploaded only if the sandbox is then paused for good). A hibernation must keep the
    memory: a volume in use fails it (`OperationFailed`)."""
    sandbox_id = record.id
    live = node.live_of(sandbox_id)
    sandbox_dir = node.dirs(sandbox_id)[0]
    seq = record.checkpoint_seq + 1
    target = checkpoints.pause_dir(sandbox_dir, seq)
    # A checkpoint names the memory file it lies over: a lazily served one must be local.
    await node.saved.lazy.whole(sandbox_id)
    node.catalog.transition(sandbox_id, [SandboxState.RUNNING], SandboxState.PAUSING)
    if to is SandboxState.PAUSED:
        node.cancel_timer(sandbox_id)
    live.planned_exit = True
    # Undone on a failure only: a save cancelled (the server going down) leaves the row
    # PAUSING and its partial checkpoint, as a crash does, for the restart (`startup`).
    try:
        hibernating = to is SandboxState.HIBERNATED
        released = volumes_released(
            node, record, live, mode, keep_running=False, memory_required=hibernating
        )
        async with released as kept:
            if kept is SaveMode.FILESYSTEM:
                await node.envd_of(record).sync()
            await asyncio.to_thread(target.mkdir)
            saved = await live.vm.snapshot(
                SnapshotTarget(target, target), keep_running=False, machine_state=kept.memory
            )
    except (*FAILURES, VolumeInUse) as e:
        await remove_tree(target)
        _run_on(node, sandbox_id, live)
        raise OperationFailed(f"pause of sandbox {sandbox_id} failed: {e}") from e
    node.live.pop(sandbox_id, None)
    await node.stop(sandbox_id, live)
    await node.saved.lazy.end(sandbox_id)  # now, not when its watch runs: the upload's order
    paused = node.catalog.transition(
        sandbox_id, [SandboxState.PAUSING], to, checkpoint_seq=seq, checkpoint_mode=kept
    )
    assert paused is not None
    await node.settling.cancel(sandbox_id)  # an earlier pause's: uploads stay in order
    await asyncio.to_thread(checkpoints.prune_pauses, sandbox_dir, seq)
    if to is SandboxState.PAUSED:
        node.events.record(EventType.PAUSED, paused, ends_execution=True)
        node.settling.start(sandbox_id, settle(node, paused, seq, saved))
    return paused


def _run_on(node: Node, sandbox_id: str, live: Live) -> None:
    """After a failed save: the sandbox runs on, its timeout with it."""
    live.planned_exit = False
    running = node.catalog.transition(sandbox_id, [SandboxState.PAUSING], SandboxState.RUNNING)
    if running is not None:
        node.schedule_expiry(running)


async def _pause_hibernated(node: Node, record: SandboxRecord) -> SandboxRecord:
    """A pause of a hibernated sandbox (the caller holds the lock): its checkpoint is the
    pause's, detached and uploaded as a pause's; its timeout stops."""
    paused = node.catalog.transition(record.id, [SandboxState.HIBERNATED], SandboxState.PAUSED)
    assert paused is not None
    node.cancel_timer(record.id)
    node.events.record(EventType.PAUSED, paused, ends_execution=True)
    saved = await node.saved.paused_checkpoint(paused)
    node.settling.start(record.id, settle(node, paused, paused.checkpoint_seq, saved))
    return paused


async def settle(node: Node, record: SandboxRecord, seq: int, saved: Snapshot) -> None:
    """Step 5, after a pause returns: detach the checkpoint's memory, so the resume maps it
    rather than parses it (unless the sandbox was resumed first), then upload the
    checkpoint."""
    directory = checkpoints.pause_dir(node.dirs(record.id)[0], seq)
    try:
        detached = await node.detacher.detach(saved, directory)
        if detached is None:
            detached = await node.detacher.merge(saved, directory)
        if detached is not None:
            async with node.lock(record.id):
                current = node.catalog.get(record.id)
                if (
                    current is not None
                    and current.state is SandboxState.PAUSED
                    and current.checkpoint_seq == seq
                ):
                    await asyncio.to_thread(detach.adopt, directory, detached)
                    saved = detached
                else:
                    await asyncio.to_thread(detach.discard, directory)
    finally:
        # Also when cancelled: whoever cancels (kill, shutdown) decides about the upload.
        node.saved.push_checkpoint(record, seq, saved)


@contextlib.asynccontextmanager
async def volumes_released(
    node: Node,
    record: SandboxRecord,
    live: Live,
    mode: SaveMode,
    *,
    keep_running: bool,
    memory_required: bool = False,
) -> AsyncIterator[SaveMode]:
    """Around a save of running `record` with `mode`: yields the mode the save can have.
    QEMU saves no mounted 9p device, so a guest with volumes unmounts them first (envd
    covers their paths meanwhile, see `aenv.envd.mounts`), and mounts them again after a
    save it runs on (`keep_running`) or one that failed. When one is in use, or the VM has
    fewer share slots than volumes (booted before they came; a restore of its state could
    not attach them), the save keeps only the filesystem: the volumes are on the host, and
    mounted again at the next boot. With `memory_required`, that raises `VolumeInUse`."""
    if not (record.volume_mounts and mode.memory):
        yield mode
        return
    mounts = guest_mounts(record.volume_mounts)
    envd = node.envd_of(record)
    if live.vm.share_slots < len(mounts) or not await envd.release_volumes(mounts):
        if memory_required:
            raise VolumeInUse(f"sandbox {record.id}: a volume is in use")
        log.info("sandbox %s: volumes stay mounted, its filesystem alone is saved", record.id)
        yield SaveMode.FILESYSTEM
        return
    async with contextlib.AsyncExitStack() as undo:
        undo.push_async_callback(_mount_again, envd, record.id, mounts)
        yield mode
        undo.pop_all()
    if keep_running:
        await envd.mount_volumes(mounts)


async def _mount_again(envd: EnvdClient, sandbox_id: str, mounts: list[dict[str, str]]) -> None:
    """The undo of a release of volumes, after a save that failed."""
    try:
        await envd.mount_volumes(mounts)
    except EnvdUnavailable:  # the save's failure is what its caller reports
        log.exception("sandbox %s: volumes not mounted again", sandbox_id)
