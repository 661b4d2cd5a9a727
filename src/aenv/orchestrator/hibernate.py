"""Hibernating idle sandboxes (`hibernation` keeps their idle clocks): a look every
`Hibernation.interval` pauses each sandbox found idle into state HIBERNATED; its next request
wakes it (`restore.wake`).

1. Under the sandbox's lock, check it still runs and is still due (traffic may have come
   while it waited for the lock).
2. Ask its envd whether a command still runs: if so, its idle clock starts again.
3. Check it is still due (traffic may have come while envd was asked).
4. Pause it into HIBERNATED (`save.pause_locked`): its timeout keeps running.
"""

from __future__ import annotations

import asyncio
import logging

from aenv.orchestrator import save
from aenv.orchestrator.envd_client import EnvdUnavailable
from aenv.orchestrator.errors import OperationFailed, SandboxNotFound
from aenv.orchestrator.hibernation import guest_runs_commands
from aenv.orchestrator.kinds import SaveMode
from aenv.orchestrator.node import Node
from aenv.orchestrator.states import SandboxState

log = logging.getLogger("aenv.orchestrator")


async def hibernate_forever(node: Node) -> None:
    while True:
        await asyncio.sleep(node.hibernation.interval)
        await hibernate_idle(node)


async def hibernate_idle(node: Node) -> None:
    """One look for idle sandboxes (`hibernation.Hibernation.due`): each is hibernated
    unless its guest still runs a command, or holds a volume in use (its save would keep
    only the filesystem, see `save.volumes_released`), either of which starts its idle clock
    again."""
    running = [r.id for r in node.catalog.list([SandboxState.RUNNING]) if not r.internal]
    node.hibernation.keep_only(running)
    for sandbox_id in node.hibernation.due(running):
        try:
            await _hibernate(node, sandbox_id)
        except (SandboxNotFound, EnvdUnavailable, OperationFailed) as e:
            log.info("sandbox %s not hibernated: %s", sandbox_id, e)
            node.hibernation.awake(sandbox_id)


async def _hibernate(node: Node, sandbox_id: str) -> None:
    async with node.lock(sandbox_id):
        record = node.catalog.get(sandbox_id)
        if record is None or record.state is not SandboxState.RUNNING:
            return
        if sandbox_id not in node.hibernation.due([sandbox_id]):
            return
        if await guest_runs_commands(node.envd_of(record)):
            node.hibernation.awake(sandbox_id)
            return
        if sandbox_id not in node.hibernation.due([sandbox_id]):
            return
        await save.pause_locked(node, record, SaveMode.FULL, SandboxState.HIBERNATED)
        log.info("sandbox %s hibernated", sandbox_id)
