"""Saving a sandbox's state as a template: a named snapshot, a template build's result (or a
cached step of it), a fork's checkpoint. The sandbox keeps running, or stays paused.

Snapshots and fork checkpoints are stored as templates (E2B does the same: a snapshot id is a
template id, created from and deleted like one). Sandboxes record which saved directory they
were restored from (`SandboxRecord.restored_from`); a fork checkpoint or a deleted snapshot is
removed once no sandbox depends on it any more.

1. Wake a hibernated sandbox (it is saved as it runs); pin the new build's directory.
2. Under the sandbox's lock, check the host's reserve; make the build's directory and its
   memory directory (tmpfs).
3. A running sandbox: seal its disks in its own directory (the VM continues on top of them),
   save its state and memory (RUNNING -> SNAPSHOTTING -> RUNNING), then flatten the sealed
   disks into the build. A paused one: export its newest checkpoint into the build.
4. Detach the memory into one file, when asked (templates every sandbox restores).
5. Record the template; a snapshot is uploaded to the repository in the background.
On failure the build's directories are removed and the sandbox is left as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

from aenv.envd import ENVD_VERSION
from aenv.ids import new_build_id, new_sandbox_id
from aenv.orchestrator import capacity, checkpoints, restore
from aenv.orchestrator.catalog import SandboxRecord
from aenv.orchestrator.errors import InvalidState, OperationFailed
from aenv.orchestrator.events import EventType
from aenv.orchestrator.kinds import SaveMode, TemplateKind
from aenv.orchestrator.node import FAILURES, Node, remove_tree
from aenv.orchestrator.save import volumes_released
from aenv.orchestrator.states import SandboxState
from aenv.orchestrator.templates import Template
from aenv.runtime.driver import Snapshot, SnapshotTarget
from aenv.timing import Steps

log = logging.getLogger("aenv.orchestrator")


async def snapshot(
    node: Node, sandbox_id: str, *, name: str | None = None, mode: SaveMode = SaveMode.FULL
) -> Template:
    """A persistent, named snapshot of the sandbox, which keeps running (or stays paused).
    A name already used by a snapshot gets this new state under the same id."""
    existing = _snapshot_named(node, name, node.get(sandbox_id).team_id)
    template_id = existing.template_id if existing else new_sandbox_id()
    aliases = (name,) if name else ()
    template = await checkpoint(node, sandbox_id, template_id, TemplateKind.SNAPSHOT, aliases, mode)
    if existing is not None:
        await node.saved.collect()  # the previous state, unless sandboxes still use it
        await node.saved.drop(existing.manifest_id)
    return template


async def save_template(
    node: Node, sandbox_id: str, template_id: str, kind: TemplateKind, aliases: tuple[str, ...]
) -> Template:
    """Save a running sandbox's state as a new build of `template_id` (template builds: the
    finished template, memory included, and its cached intermediate steps, disks only)."""
    # A cached step keeps only its disks, as a Docker layer does: its memory would stay on
    # tmpfs (RAM) for a rebuild that may never come, a VM's size per RUN step (18 GiB for
    # code-interpreter-v1's nine), past a host's /dev/shm. A rebuild cold-boots from it.
    layer = kind is TemplateKind.BUILD_LAYER
    template = await checkpoint(
        node,
        sandbox_id,
        template_id,
        kind,
        aliases,
        SaveMode.FILESYSTEM if layer else SaveMode.FULL,
        detach_memory=kind is TemplateKind.TEMPLATE,
    )
    await node.saved.collect()  # the build it replaced, unless sandboxes still use it
    return template


async def delete_template(node: Node, template_id: str) -> None:
    """Delete a template or snapshot for users; its files go once no sandbox uses them."""
    node.templates.hide(template_id)
    for listener in list(node.template_deleted):
        await listener(template_id)
    await node.saved.collect()


def _snapshot_named(node: Node, name: str | None, team_id: str) -> Template | None:
    """The snapshot of `team_id` called `name`: names are unique within a team."""
    if name is None:
        return None
    for template in node.templates.list(kind=TemplateKind.SNAPSHOT):
        if name in template.aliases and template.team_id == team_id:
            return template
    return None


async def checkpoint(
    node: Node,
    sandbox_id: str,
    template_id: str,
    kind: TemplateKind,
    aliases: tuple[str, ...],
    mode: SaveMode,
    *,
    detach_memory: bool = False,
) -> Template:
    """Save the sandbox's current state as template `template_id` (a new build of it), its
    memory detached into a file first when `detach_memory` (see detach.py)."""
    await restore.wake(node, sandbox_id)
    dest = node.templates.directory / template_id / new_build_id()
    steps = Steps()
    with node.saved.pin(dest):  # until the template names it
        record, kept = await _save_into(node, dest, sandbox_id, kind, mode, detach_memory, steps)
        template = Template(
            template_id=template_id,
            build_id=dest.name,
            aliases=aliases,
            cpu_count=record.cpu_count,
            memory_mb=record.memory_mb,
            disk_size_mb=record.disk_size_mb,
            envd_version=ENVD_VERSION,
            envd_access_token=record.envd_access_token or "",
            created_at=time.time(),
            snapshot_dir=str(dest),
            kind=kind,
            source_sandbox_id=sandbox_id,
            save_mode=kept,
            metadata=dict(record.metadata),
            team_id=record.team_id,
        )
        await asyncio.to_thread(node.templates.save, template)
    steps.mark("template")
    log.info("checkpoint of %s as %s: %s", sandbox_id, kind, steps)
    if kind is TemplateKind.SNAPSHOT:
        node.events.record(EventType.CHECKPOINTED, record)
        node.spawn(node.saved.push_template(template))
    return template


async def _save_into(
    node: Node,
    dest: Path,
    sandbox_id: str,
    kind: TemplateKind,
    mode: SaveMode,
    detach_memory: bool,
    steps: Steps,
) -> tuple[SandboxRecord, SaveMode]:
    """Steps 2-4: the sandbox's state in `dest`; its record and the mode the state has."""
    # Its memory file on tmpfs, as a template's: restores map it.
    memory_dir = node.templates.build_memory_dir(dest.parent.name, dest.name)
    async with node.lock(sandbox_id):
        steps.mark("lock")
        record = node.get(sandbox_id)
        await capacity.check_reserve(node, f"save sandbox {sandbox_id}")
        async with contextlib.AsyncExitStack() as undo:
            for directory in (dest, memory_dir):
                await asyncio.to_thread(directory.mkdir, parents=True)
                undo.push_async_callback(remove_tree, directory)
            if record.state is SandboxState.RUNNING:
                saved, kept = await _save_running(node, record, dest, memory_dir, mode, steps)
            elif record.state is SandboxState.PAUSED:
                saved, kept = await _export_paused(node, record, dest, memory_dir, mode)
            else:
                raise InvalidState(sandbox_id, record.state, "snapshot")
            if detach_memory and kept is SaveMode.FULL:
                # Templates are restored by every sandbox: one memory file that all of
                # them share beats each loading the pages the build changed.
                saved = await node.detacher.detach_in_place(
                    saved, dest, flatten=kind is TemplateKind.TEMPLATE
                )
                steps.mark("detach")
            undo.pop_all()
    return record, kept


async def _save_running(
    node: Node,
    record: SandboxRecord,
    dest: Path,
    memory_dir: Path,
    mode: SaveMode,
    steps: Steps,
) -> tuple[Snapshot, SaveMode]:
    """Step 3 for a running sandbox, which continues: its disks are sealed in its own
    directory (the VM continues on top of them), its state (with `mode` FULL) goes to `dest`
    and its memory file to `memory_dir`, and the sealed disks are flattened into `dest`. The
    time of each step goes into `steps`."""
    live = node.live_of(record.id)
    await node.saved.lazy.whole(record.id)  # the snapshot takes the memory file it maps
    async with volumes_released(node, record, live, mode, keep_running=True) as kept:
        if kept is SaveMode.FILESYSTEM:
            await node.envd_of(record).sync()
        seq = record.checkpoint_seq + 1
        staging = checkpoints.staging_dir(node.dirs(record.id)[0], seq)
        node.catalog.transition(record.id, [SandboxState.RUNNING], SandboxState.SNAPSHOTTING)
        try:
            await asyncio.to_thread(staging.mkdir)
            snap = await live.vm.snapshot(
                SnapshotTarget(staging, memory_dir), keep_running=True, machine_state=kept.memory
            )
        except FAILURES as e:
            await remove_tree(staging)
            raise OperationFailed(f"snapshot of sandbox {record.id} failed: {e}") from e
        finally:
            node.catalog.transition(
                record.id, [SandboxState.SNAPSHOTTING], SandboxState.RUNNING, checkpoint_seq=seq
            )
        steps.mark("save")
        exported = await node.driver.export(snap, dest, move=True, memory_dir=memory_dir)
        steps.mark("export")
    return exported, kept


async def _export_paused(
    node: Node, record: SandboxRecord, dest: Path, memory_dir: Path, mode: SaveMode
) -> tuple[Snapshot, SaveMode]:
    """Step 3 for a paused sandbox: its newest checkpoint, exported into `dest`."""
    if mode is SaveMode.FILESYSTEM and record.checkpoint_mode is SaveMode.FULL:
        # Its disks lack what the guest had not written back when it paused.
        raise InvalidState(
            record.id, record.state, "take a filesystem-only snapshot of", "resume it first"
        )
    try:
        paused = await node.saved.paused_checkpoint(record)
        saved = await node.driver.export(paused, dest, move=False, memory_dir=memory_dir)
    except FAILURES as e:
        raise OperationFailed(f"snapshot of {record.id} failed: {e}") from e
    return saved, SaveMode.FILESYSTEM if record.checkpoint_mode is SaveMode.FILESYSTEM else mode
