"""Forking: `count` new sandboxes from the state of a sandbox (running or paused) or of a
snapshot, each with its own id, token, slot and entropy.

1. Check the disk holds every child, before anything changes.
2. Checkpoint a sandbox source once, as a FORK template (a snapshot is used as it is).
3. Pin it, and create the children concurrently through admission (`create`). A child that
   fails leaves nothing; the others run.
4. Collect: the checkpoint goes now if no child started from it, else with the last.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from aenv.ids import new_sandbox_id
from aenv.network.settings import SandboxNetwork
from aenv.orchestrator import capacity
from aenv.orchestrator.catalog import SandboxRecord
from aenv.orchestrator.create import CreateRequest, create_from
from aenv.orchestrator.errors import SandboxNotFound
from aenv.orchestrator.kinds import SaveMode, TemplateKind
from aenv.orchestrator.node import Node
from aenv.orchestrator.snapshot import checkpoint
from aenv.orchestrator.templates import Template

log = logging.getLogger("aenv.orchestrator")


async def fork(
    node: Node, source: str, count: int, timeout: int, *, owner: str | None = None
) -> list[SandboxRecord | BaseException]:
    """One entry per child, a record or its error."""
    parent: SandboxRecord | None
    try:
        parent = node.get(source)
    except SandboxNotFound:
        parent = None
    start = time.perf_counter()
    if parent is None:
        try:
            base = node.templates.get(source)
        except LookupError as e:
            raise SandboxNotFound(source) from e
        await capacity.check_disk(node, count * base.disk_size_mb)
    else:
        # Refused before the checkpoint: a fork that cannot fit changes nothing.
        await capacity.check_disk(node, count * parent.disk_size_mb)
        # With more than one child, detaching the memory once beats each child parsing
        # it; a checkpoint of changed pages over a memory file is not detached: each child
        # loads only those pages (in memory layers: merged once, not composed per child).
        base = await checkpoint(
            node,
            source,
            new_sandbox_id(),
            TemplateKind.FORK,
            (),
            SaveMode.FULL,
            detach_memory=count > 1,
        )
    saved = time.perf_counter()
    with node.saved.pin(Path(base.snapshot_dir)):
        children = await _start_children(node, base, parent, count, timeout, owner)
    log.info(
        "fork of %s: checkpoint %.0f ms, %d children %.0f ms",
        source,
        (saved - start) * 1000,
        count,
        (time.perf_counter() - saved) * 1000,
    )
    await node.saved.collect()  # a fork checkpoint no child started from
    return children


async def _start_children(
    node: Node,
    base: Template,
    parent: SandboxRecord | None,
    count: int,
    timeout: int,
    owner: str | None,
) -> list[SandboxRecord | BaseException]:
    request = CreateRequest(
        template=base.template_id,
        timeout=timeout,
        metadata=parent.metadata if parent else {},
        env_vars=parent.env_vars if parent else {},
        auto_pause=parent.auto_pause if parent else False,
        auto_resume=parent.auto_resume if parent else False,
        network=parent.network if parent else SandboxNetwork(),
        owner=owner,
        # Children of a sandbox mount its volumes; a snapshot carries none.
        volume_mounts=parent.volume_mounts if parent else (),
    )
    children = await asyncio.gather(
        *(create_from(node, request, base, parent) for _ in range(count)),
        return_exceptions=True,
    )
    return list(children)
