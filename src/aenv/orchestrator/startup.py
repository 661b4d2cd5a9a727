"""A node's start and graceful shutdown.

At start, take over what a previous process left. VMs never survive it (the start-up sweep
kills them), so:
1. Reap the previous server's strays; attach the volumes.
2. Keep saved sandboxes, paused (one caught mid-pause or mid-resume falls back to its newest
   complete checkpoint); reclaim every other sandbox's files and row.
3. Remove pooled VMs' directories, detach scratch and saved states cut short.
4. Collect saved states nothing uses; start the background loops (uploads, housekeeping,
   metrics, hibernation, pool refills, webhook deliveries left queued).

At shutdown, pooled VMs are stopped; running sandboxes are paused (resumable after the
restart), or killed when `pause_on_shutdown` is off or the pause fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil

from aenv.orchestrator import checkpoints, ending, housekeeping, pooling, save, warm
from aenv.orchestrator.catalog import SandboxRecord
from aenv.orchestrator.errors import InvalidState, OperationFailed, SandboxNotFound
from aenv.orchestrator.events import EventType, KillReason
from aenv.orchestrator.hibernate import hibernate_forever
from aenv.orchestrator.node import Node
from aenv.orchestrator.states import ASLEEP, RUNS, SAVED, SandboxState
from aenv.runtime.sweep import reap_strays
from aenv.storage import lazytree

log = logging.getLogger("aenv.orchestrator")


async def start(node: Node) -> None:
    # Also those of the previous server that the start-up sweep cannot tell from others'
    # (re-parented to a subreaper, not to init): they would write to the files reclaimed here.
    await asyncio.to_thread(reap_strays, node.config.home)
    # Lazily served files of its VMs, dead with it: their directories are reclaimed below.
    for mount in await asyncio.to_thread(lazytree.sweep, node.config.home):
        log.warning("detached %s, a lazy mount the previous run left", mount)
    await node.volumes.attach_all()
    for record in node.catalog.list():
        if record.state in SAVED and await _recover_saved(node, record):
            continue
        log.warning("reclaiming sandbox %s left in state %s", record.id, record.state)
        await node.reclaim_files(record.id)
        await node.saved.drop_archived(record)
        node.catalog.delete(record.id)
        if record.state.public is not None:  # a create cut short had no created event
            node.events.record(
                EventType.KILLED,
                record,
                {"kill_reason": KillReason.ORPHANED.value},
                ends_execution=record.state in RUNS,
            )
    await asyncio.to_thread(_sweep_pooled, node)
    await asyncio.to_thread(node.detacher.sweep)
    for unfinished in await asyncio.to_thread(node.templates.remove_unfinished):
        log.warning("removed saved state %s, cut short by the previous run", unfinished)
    await node.saved.collect()
    node.spawn(node.saved.collect_repository())
    node.spawn(housekeeping.housekeeping(node))
    node.spawn(housekeeping.sample_forever(node))
    if node.hibernation.enabled:
        node.spawn(hibernate_forever(node))
    if node.pools.enabled:
        node.refiller = asyncio.get_running_loop().create_task(pooling.refill_forever(node))
    node.webhooks.wake()  # what the previous run left queued


def _sweep_pooled(node: Node) -> None:
    """Remove the directories of VMs a previous process held in its pools (their VMMs are
    gone with it): marked ones that no catalog row names."""
    sandboxes = node.paths.sandboxes
    if not sandboxes.is_dir():
        return
    for directory in sandboxes.iterdir():
        if (directory / warm.MARKER).exists() and node.catalog.get(directory.name) is None:
            log.warning("removing pooled VM %s left by the previous run", directory.name)
            for path in node.dirs(directory.name):
                shutil.rmtree(path, ignore_errors=True)


async def _recover_saved(node: Node, record: SandboxRecord) -> bool:
    """Whether a sandbox the previous process left saved (or mid-save) stays, paused.

    One caught mid-pause falls back to its newest complete checkpoint, which is at least
    the one its row names. One whose named checkpoint is gone from this disk stays paused
    at it when the repository holds a copy (a resume pulls it back), and also when only
    an older checkpoint is left, here or there: its resume then fails saying so, rather
    than bringing back an older state without a word. With nothing left, it is
    reclaimed."""
    sandbox_dir = node.dirs(record.id)[0]
    found = await asyncio.to_thread(checkpoints.latest_pause, sandbox_dir)
    if found is not None and found[0] >= record.checkpoint_seq:
        seq, snapshot = found
        await asyncio.to_thread(checkpoints.prune_pauses, sandbox_dir, seq)
        paused = node.catalog.transition(
            record.id, [record.state], SandboxState.PAUSED, checkpoint_seq=seq
        )
        _paused_by_restart(node, record, paused)
        # A pause's upload starts once its detach or merge has ended, a hibernated
        # sandbox's never: a crash before then left no copy of this checkpoint.
        if paused is not None and (paused.archived is None or paused.archived.seq != seq):
            node.saved.push_checkpoint(paused, seq, snapshot)
        return True
    if found is None and record.archived is None:
        return False
    copied = record.archived is not None and record.archived.seq == record.checkpoint_seq
    log.warning(
        "sandbox %s: its checkpoint %d is not on this disk; %s",
        record.id,
        record.checkpoint_seq,
        "a resume pulls its repository copy" if copied else "it cannot be resumed",
    )
    _paused_by_restart(
        node, record, node.catalog.transition(record.id, [record.state], SandboxState.PAUSED)
    )
    return True


def _paused_by_restart(node: Node, before: SandboxRecord, paused: SandboxRecord | None) -> None:
    """A sandbox that ran for its users (mid-pause, hibernated) and is paused now: its event.
    One that was paused (or mid-resume) already had it."""
    if paused is not None and before.state in RUNS:
        node.events.record(EventType.PAUSED, paused, ends_execution=True)


async def close(node: Node) -> None:
    if node.refiller is not None:
        node.refiller.cancel()
        await asyncio.gather(node.refiller, return_exceptions=True)
    for pooled in node.pools.drain():
        await pooling.discard(node, pooled)
    # PAUSING too: a pause or hibernation under way ends before its sandbox is parked.
    running = [
        r.id for r in node.catalog.list([SandboxState.RUNNING, SandboxState.PAUSING, *ASLEEP])
    ]
    await asyncio.gather(*(_park(node, sandbox_id) for sandbox_id in running))
    for sandbox_id in list(node.live):
        await ending.kill(node, sandbox_id, KillReason.ADMIN)
    # After the last events: what is not delivered stays queued for the next start.
    await node.webhooks.close()
    # Checkpoints are uploaded as they are: detaching their memory is only worth it for a
    # restore soon, and the restarted server can restore either form.
    for sandbox_id in node.settling.ids():
        await node.settling.cancel(sandbox_id)
    await node.saved.close()
    for task in list(node.tasks):
        task.cancel()
    await node.client.aclose()
    await node.volumes.detach_all()


async def _park(node: Node, sandbox_id: str) -> None:
    async with node.lock(sandbox_id):  # a pause or hibernation under way ends first
        record = node.catalog.get(sandbox_id)
    if record is None or record.state is SandboxState.PAUSED:
        return
    if node.config.pause_on_shutdown and not record.internal:
        with contextlib.suppress(SandboxNotFound, InvalidState, OperationFailed):
            await save.pause(node, sandbox_id)
            return
    await ending.kill(node, sandbox_id, KillReason.ADMIN)
