"""Moving sandboxes and saved states between nodes of a cluster that share one snapshot
repository: a node releases a sandbox, another adopts it (or a template) from the copy.

A release:
1. Pause the sandbox if it runs; wait for its last pause's detach and upload.
2. Under its lock, check the repository holds its newest checkpoint.
3. Forget it here (VM, files, row), its repository copy kept: it is the adopter's now.
An adopt records the paused sandbox here; its resume pulls the repository's copy.
"""

from __future__ import annotations

import asyncio
import dataclasses

from aenv.orchestrator import ending, save
from aenv.orchestrator.catalog import SandboxRecord
from aenv.orchestrator.errors import InvalidState, OperationFailed
from aenv.orchestrator.kinds import TemplateKind
from aenv.orchestrator.node import Node
from aenv.orchestrator.residency import tell
from aenv.orchestrator.states import ASLEEP, SandboxState
from aenv.orchestrator.templates import Template


async def release(node: Node, sandbox_id: str) -> SandboxRecord:
    """Give a sandbox up to another node. Returns the record for `adopt`. Raises
    `InvalidState` when it is neither running nor paused or mounts volumes,
    `OperationFailed` when no copy reached the repository (it stays here, paused)."""
    if node.saved.archive is None:
        raise OperationFailed(
            f"sandbox {sandbox_id} cannot move: this node has no snapshot repository"
        )
    record = node.get(sandbox_id)
    if record.volume_mounts:
        # Volumes are directories of this node: elsewhere its mounts would find nothing.
        raise InvalidState(sandbox_id, record.state, "move", "it mounts volumes of this node")
    if record.state in (SandboxState.RUNNING, *ASLEEP):
        await save.pause(node, sandbox_id)
    settling = node.settling.get(sandbox_id)
    if settling is not None:
        await asyncio.gather(settling, return_exceptions=True)
    await node.saved.wait_push(sandbox_id)
    async with node.lock(sandbox_id):
        record = node.get(sandbox_id)
        if record.state is not SandboxState.PAUSED:
            raise InvalidState(sandbox_id, record.state, "move")
        if record.archived is None or record.archived.seq != record.checkpoint_seq:
            raise OperationFailed(
                f"sandbox {sandbox_id} cannot move: its checkpoint did not reach the "
                "repository (see the node's log)"
            )
        await ending.forget_locked(node, sandbox_id)
    await tell(node.residency, lambda r: r.sandbox_gone(sandbox_id), f"{sandbox_id} left")
    await node.saved.collect()
    return record


async def adopt(node: Node, record: SandboxRecord) -> SandboxRecord:
    """Take a paused sandbox another node released (or lost with its node): it is paused
    here, and its resume pulls the repository's copy of its checkpoint. An id this node
    holds already is left as it is. Raises `InvalidState` for a record that is not paused
    with a copy in the repository."""
    if record.state is not SandboxState.PAUSED or record.archived is None:
        raise InvalidState(record.id, record.state, "adopt", "no copy in the repository")
    if node.saved.archive is None:
        raise OperationFailed(f"cannot adopt {record.id}: this node has no repository")
    async with node.lock(record.id):
        existing = node.catalog.get(record.id)
        if existing is not None:
            return existing
        # Its own files are in the repository's copy: nothing here is its base.
        adopted = node.catalog.insert(dataclasses.replace(record, restored_from=""))
    await tell(node.residency, lambda r: r.sandbox_routed(record.id), f"{record.id} came")
    return adopted


async def adopt_template(node: Node, template: Template) -> Template:
    """Take a snapshot or built template another node made, whose copy is in the shared
    repository: it is recorded here under this node's directories, and the first sandbox
    started from it pulls its files. The same build held already is left as it is. Raises
    `OperationFailed` without a repository or a copy to pull."""
    if node.saved.archive is None:
        raise OperationFailed(f"cannot adopt {template.template_id}: no repository here")
    movable = (TemplateKind.SNAPSHOT, TemplateKind.TEMPLATE)
    if template.manifest_id is None or template.kind not in movable:
        raise OperationFailed(
            f"cannot adopt {template.template_id}: only snapshots and built templates "
            "stored in the repository move between nodes"
        )
    existing = node.templates.by_id(template.template_id)
    if existing is not None and existing.build_id == template.build_id:
        return existing
    build_dir = node.templates.directory / template.template_id / template.build_id
    adopted = dataclasses.replace(template, snapshot_dir=str(build_dir), deleted=False)
    await asyncio.to_thread(build_dir.parent.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread(node.templates.save, adopted)
    return adopted


async def forget(node: Node, sandbox_id: str) -> bool:
    """Drop a sandbox that lives on another node now (this node was cut off while it
    moved): its VM stops and its files go here, its repository copy stays (the other
    node's). False when it is not here."""
    async with node.lock(sandbox_id):
        if node.catalog.get(sandbox_id) is None:
            return False
        await ending.forget_locked(node, sandbox_id)
    await node.saved.collect()
    return True
