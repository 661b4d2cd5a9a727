"""Forking: new sandboxes from the state of a sandbox (running or paused) or of a snapshot, each
with its own id, token, slot and entropy, and the source's metadata and env vars with what its
`Child` adds (a batch fork labels each child: its rank, its task).

1. Check the disk holds every child, before anything changes.
2. Checkpoint a sandbox source once, as a FORK template (a snapshot is used as it is).
3. Pin it, and create the children concurrently through admission (`create`). A child that
   fails leaves nothing; the others run.
4. Collect: the checkpoint goes now if no child started from it, else with the last.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aenv.ids import TEAM_ID, new_sandbox_id
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


@dataclass(frozen=True)
class Child:
    """What one child adds to its source's metadata and env vars (its entries win)."""

    metadata: Mapping[str, str] = field(default_factory=dict)
    env_vars: Mapping[str, str] = field(default_factory=dict)


async def fork(
    node: Node,
    source: str,
    children: Sequence[Child],
    timeout: int,
    *,
    owner: str | None = None,
    team_id: str = TEAM_ID,
    wait: float = 0.0,
    gone: asyncio.Event | None = None,
) -> list[SandboxRecord | BaseException]:
    """One entry per child, in order: a record or its error. Each child may wait `wait`
    seconds for capacity (the disk check of step 1 does not wait)."""
    count = len(children)
    parent: SandboxRecord | None
    try:
        parent = node.get(source)
    except SandboxNotFound:
        parent = None
    start = time.perf_counter()
    if parent is None:
        try:
            base = node.templates.get(source, team_id)
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
        started = await _start_children(
            node, base, parent, children, timeout, owner, team_id, wait, gone
        )
    log.info(
        "fork of %s: checkpoint %.0f ms, %d children %.0f ms",
        source,
        (saved - start) * 1000,
        count,
        (time.perf_counter() - saved) * 1000,
    )
    await node.saved.collect()  # a fork checkpoint no child started from
    return started


async def _start_children(
    node: Node,
    base: Template,
    parent: SandboxRecord | None,
    children: Sequence[Child],
    timeout: int,
    owner: str | None,
    team_id: str,
    wait: float,
    gone: asyncio.Event | None,
) -> list[SandboxRecord | BaseException]:
    # A snapshot's metadata is its sandbox's when it was taken; it carries no env vars.
    request = CreateRequest(
        template=base.template_id,
        timeout=timeout,
        metadata=parent.metadata if parent else base.metadata,
        env_vars=parent.env_vars if parent else {},
        auto_pause=parent.auto_pause if parent else False,
        auto_resume=parent.auto_resume if parent else False,
        network=parent.network if parent else SandboxNetwork(),
        owner=owner,
        team_id=team_id,
        # Children of a sandbox mount its volumes; a snapshot carries none.
        volume_mounts=parent.volume_mounts if parent else (),
        wait=wait,
        gone=gone,
    )
    started = await asyncio.gather(
        *(create_from(node, _labelled(request, child), base, parent) for child in children),
        return_exceptions=True,
    )
    return list(started)


def _labelled(request: CreateRequest, child: Child) -> CreateRequest:
    if not child.metadata and not child.env_vars:
        return request
    return dataclasses.replace(
        request,
        metadata={**request.metadata, **child.metadata},
        env_vars={**request.env_vars, **child.env_vars},
    )
