"""How sandboxes end: kill, the timeout (which kills, or pauses a sandbox that asked for
`autoPause`), a VMM that exits on its own, a VM that vanished; and the timeout's changes.

A kill:
1. Move the row to KILLING (from any state a kill applies to; one kill wins).
2. Stop its timer, the work after its last pause and its upload; stop its VM.
3. Remove its files, its repository copy and its row; listeners are told it left.
4. Collect saved states nothing uses any more (a fork checkpoint it was the last child of).
"""

from __future__ import annotations

import logging
import time

from aenv.orchestrator import save
from aenv.orchestrator.catalog import SandboxRecord
from aenv.orchestrator.errors import InvalidState, OperationFailed, SandboxNotFound
from aenv.orchestrator.events import EventType, KillReason, timestamp
from aenv.orchestrator.housekeeping import reconcile
from aenv.orchestrator.node import Live, Node
from aenv.orchestrator.residency import tell
from aenv.orchestrator.states import ASLEEP, KILLABLE, LIVE, RUNS, SandboxState

log = logging.getLogger("aenv.orchestrator")


async def kill(node: Node, sandbox_id: str, reason: KillReason = KillReason.REQUEST) -> bool:
    """Stop and forget a sandbox. False when it does not exist (or is already going)."""
    async with node.lock(sandbox_id):
        before = node.catalog.get(sandbox_id)
        record = node.catalog.transition(sandbox_id, KILLABLE, SandboxState.KILLING)
        if record is None or before is None:
            return False
        await forget_locked(node, sandbox_id, drop_archived=record)
        if before.state.public is not None:  # a create cut short had no created event
            node.events.record(
                EventType.KILLED,
                record,
                {"kill_reason": reason.value},
                ends_execution=before.state in RUNS,
            )
    if not record.internal:
        await tell(node.residency, lambda r: r.sandbox_gone(sandbox_id), f"{sandbox_id} left")
    await node.saved.collect()
    return True


async def forget_locked(
    node: Node, sandbox_id: str, *, drop_archived: SandboxRecord | None = None
) -> None:
    """Steps 2-3 (the caller holds the lock): stop a sandbox's VM and remove its files and
    row; with `drop_archived` (its record as the caller last saw it) also its copy in the
    repository."""
    node.cancel_timer(sandbox_id)
    await node.settling.cancel(sandbox_id)
    await node.saved.cancel_push(sandbox_id)
    live = node.live.pop(sandbox_id, None)
    if live is not None:
        await node.stop(sandbox_id, live)
    await node.reclaim_files(sandbox_id)
    if drop_archived is not None:
        await node.saved.drop_archived(node.catalog.get(sandbox_id) or drop_archived)
    node.catalog.delete(sandbox_id)


def started(node: Node, record: SandboxRecord, live: Live) -> None:
    """A sandbox runs (created, resumed, woken): its timeout, idle clock and VMM watch."""
    node.schedule_expiry(record)
    node.hibernation.awake(record.id)
    node.spawn(_watch_vmm(node, record.id, live))


async def _watch_vmm(node: Node, sandbox_id: str, live: Live) -> None:
    """A VMM that exits on its own (crash, OOM kill, kill -9) takes its sandbox with it: the
    sandbox is reported gone and its slot and files are released, other sandboxes untouched."""
    await live.vm.wait_exit()
    if live.planned_exit or node.live.get(sandbox_id) is not live:
        return
    log.warning("sandbox %s: its VMM exited unexpectedly; removing it", sandbox_id)
    await kill(node, sandbox_id, KillReason.UNKNOWN)


async def remove_vanished(node: Node, sandbox_id: str) -> None:
    """A sandbox found running without a VM (`Node.live_of`): killed, and what is left of
    its VM and slot ended."""
    await kill(node, sandbox_id, KillReason.UNKNOWN)
    await reconcile(node)


async def expire(node: Node, record: SandboxRecord) -> None:
    """Timeout: pause when the sandbox asked for it (`autoPause`), else kill."""
    log.info("sandbox %s timed out", record.id)
    if record.auto_pause:
        try:
            await save.pause(node, record.id, mode=record.auto_pause_mode)
            return
        except (SandboxNotFound, InvalidState):
            return
        except OperationFailed:
            log.exception("auto-pause of %s failed; killing it", record.id)
    await kill(node, record.id, KillReason.TIMEOUT)


def set_timeout(node: Node, sandbox_id: str, timeout: int) -> SandboxRecord:
    """The sandbox now ends `timeout` seconds from now (shorter or longer than before)."""
    record = node.get(sandbox_id)
    updated = node.catalog.update(sandbox_id, end_at=time.time() + timeout)
    if updated is None:
        raise SandboxNotFound(sandbox_id)
    if record.state in LIVE | ASLEEP:  # a hibernated sandbox's timeout runs on
        node.schedule_expiry(updated)
    node.events.record(EventType.UPDATED, updated, {"set_timeout": timestamp(updated.end_at)})
    return updated


def set_auto_pause(node: Node, sandbox_id: str, auto_pause: bool) -> SandboxRecord:
    """What the sandbox's timeout does from now on: pause it (True) or kill it."""
    updated = node.catalog.update(sandbox_id, auto_pause=auto_pause)
    if updated is None:
        raise SandboxNotFound(sandbox_id)
    node.events.record(EventType.UPDATED, updated, {"auto_pause": auto_pause})
    return updated


def extend_timeout(node: Node, sandbox_id: str, timeout: int) -> SandboxRecord:
    """Connect semantics: the end time only ever moves later."""
    record = node.get(sandbox_id)
    if record.end_at >= time.time() + timeout:
        return record
    return set_timeout(node, sandbox_id, timeout)
