"""Saved sandbox states and when they may go: restore bases (templates, snapshots, fork
checkpoints), pause checkpoints, and their copies in the snapshot repository.

Sandboxes record which saved directory they were restored from (`restored_from`); a fork
checkpoint or a deleted snapshot is removed once no sandbox depends on it and no operation has
it pinned. Pause checkpoints and snapshots are uploaded to the repository in the background
(`archive.Archive`); restores use the local files when complete and pull the repository's copy
when they are not.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from aenv.orchestrator import checkpoints
from aenv.orchestrator.archive import PREFETCH, Archive
from aenv.orchestrator.background import PerSandbox
from aenv.orchestrator.catalog import Archived, Catalog, SandboxRecord
from aenv.orchestrator.kinds import TemplateKind
from aenv.orchestrator.lazy import LazyCheckpoints
from aenv.orchestrator.states import SandboxState
from aenv.orchestrator.templates import Template, TemplateStore
from aenv.runtime.driver import (
    CorruptSavedState,
    Driver,
    DriverError,
    RestoreError,
    Snapshot,
    UnknownSavedStateFormat,
)
from aenv.storage.lazytree import LazyTree
from aenv.storage.repository import RepositoryError

log = logging.getLogger("aenv.orchestrator")


def refused(error: BaseException | None) -> bool:
    """Whether `error` refused a saved state for what it is: a file changed since its save, or
    a manifest of another program or a newer format. Trying again cannot help."""
    return isinstance(error, CorruptSavedState | UnknownSavedStateFormat)


class SavedStates:
    def __init__(
        self,
        catalog: Catalog,
        templates: TemplateStore,
        sandboxes_dir: Path,
        archive: Archive | None,
        driver: Driver,
        *,
        max_uploads: int,
        lazy_pulls: bool = False,
        lazy_prefetch: int = 0,
    ) -> None:
        self.catalog = catalog
        self.driver = driver
        self.templates = templates
        self.sandboxes_dir = sandboxes_dir
        self.archive = archive
        self._pushes = PerSandbox("checkpoint upload")
        self._upload_slots = asyncio.Semaphore(max_uploads)
        # Saved-state directories an operation is writing or about to start sandboxes from:
        # not garbage even while no sandbox row names them yet.
        self._pinned: set[str] = set()
        self._pull_locks: dict[str, asyncio.Lock] = {}
        # Resumes of checkpoints this node lacks serve their files as the guest reads them.
        self.lazy_pulls = lazy_pulls
        self.lazy_prefetch = lazy_prefetch
        self.lazy = LazyCheckpoints()
        # Templates' files served while they arrive, by directory, and the state read from
        # them: every start from the template takes that state until the node closes.
        self._served: dict[str, tuple[LazyTree, Snapshot]] = {}

    async def cancel_push(self, sandbox_id: str) -> None:
        await self._pushes.cancel(sandbox_id)

    @contextlib.asynccontextmanager
    async def push_held(self, record: SandboxRecord, checkpoint: Snapshot) -> AsyncIterator[None]:
        """Stop the upload of `record`'s checkpoint `checkpoint` while the block restores
        it: exporting and hashing it took the two cores that a resume right after its pause
        needs. A restore that succeeds leaves it stopped: the sandbox runs again, and a running
        sandbox's copy is never restored (its next pause uploads its own; a crash reclaims a
        running sandbox). One that fails starts it again when the repository has no copy of
        this checkpoint yet (also when the resume came before the upload had started), since
        the fallback to the repository's copy needs it."""
        await self.cancel_push(record.id)
        with contextlib.ExitStack() as undo:
            undo.callback(self._push_again, record, checkpoint)
            yield
            undo.pop_all()

    def _push_again(self, record: SandboxRecord, checkpoint: Snapshot) -> None:
        """The undo of `push_held`: the upload again, unless one runs or the copy is there."""
        seq = record.checkpoint_seq
        current = self.catalog.get(record.id)
        archived = current.archived if current is not None else None
        if self._pushes.get(record.id) is None and (archived is None or archived.seq != seq):
            self.push_checkpoint(record, seq, checkpoint)

    async def wait_push(self, sandbox_id: str) -> None:
        """Until the sandbox's checkpoint upload under way, if any, has ended."""
        push = self._pushes.get(sandbox_id)
        if push is not None:
            await asyncio.gather(push, return_exceptions=True)

    async def drop(self, manifest_id: str | None) -> None:
        if manifest_id is not None and self.archive is not None:
            await self.archive.drop(manifest_id)

    async def collect_repository(self) -> None:
        if self.archive is not None:
            await self.archive.collect()

    async def close(self) -> None:
        """Uploads of checkpoints already taken finish first: they are the durable copies."""
        await self._pushes.wait_all()
        for directory in list(self._served):
            await self._end_served(directory)
        if self.archive is not None:
            self.archive.close()

    async def collect(self) -> None:
        """Remove saved states nothing needs any more: fork checkpoints and deleted templates
        no sandbox was restored from, and builds of snapshots that a newer build replaced."""
        used = {r.restored_from for r in self.catalog.list()} | self._pinned
        for template in self.templates.list_all():
            template_dir = self.templates.directory / template.template_id
            dropped = template.deleted or template.kind is TemplateKind.FORK
            in_use = {u for u in used if u.startswith(f"{template_dir}/")}
            if dropped and not in_use:
                for directory in [d for d in self._served if d.startswith(f"{template_dir}/")]:
                    await self._end_served(directory)
                await asyncio.to_thread(self.templates.delete, template.template_id)
                await self.drop(template.manifest_id)
                continue
            if template.kind not in (TemplateKind.SNAPSHOT, TemplateKind.TEMPLATE):
                continue
            for build in template_dir.iterdir():
                stale = build.is_dir() and str(build) != template.snapshot_dir
                if stale and str(build) not in in_use:
                    await asyncio.to_thread(shutil.rmtree, build, True)
                    memory = self.templates.build_memory_dir(template.template_id, build.name)
                    await asyncio.to_thread(shutil.rmtree, memory, True)

    @contextlib.contextmanager
    def pin(self, directory: Path) -> Iterator[None]:
        """Keep `directory` while an operation writes it or starts sandboxes from it."""
        self._pinned.add(str(directory))
        try:
            yield
        finally:
            self._pinned.discard(str(directory))

    def push_checkpoint(self, record: SandboxRecord, seq: int, saved: Snapshot) -> None:
        """Upload pause checkpoint `seq` in the background; the row then names its manifest
        (and the manifest of the checkpoint before it is dropped)."""
        if self.archive is None:
            return
        archive = self.archive

        metadata = {"sandbox": record.id}
        order = self.lazy.prefetch_order(record.id)
        if order is not None:
            metadata[PREFETCH] = json.dumps(order)

        async def push() -> None:
            staging = checkpoints.archive_dir(self.sandboxes_dir / record.id, seq)
            async with self._upload_slots:
                await asyncio.to_thread(shutil.rmtree, staging, True)  # a crash's leftover
                manifest_id = await archive.push_checkpoint(
                    saved,
                    staging,
                    self.driver,
                    name=f"sandbox-{record.id}-{seq}",
                    metadata=metadata,
                )
            current = self.catalog.get(record.id)
            if current is None or current.state is SandboxState.KILLING:
                await archive.drop(manifest_id)
                return
            self.catalog.update(record.id, archived=Archived(seq, manifest_id))
            if current.archived is not None:
                await archive.drop(current.archived.manifest)

        self._pushes.start(record.id, push())

    async def paused_checkpoint(self, record: SandboxRecord, *, pull: bool = False) -> Snapshot:
        """A paused sandbox's checkpoint, the one its row names (`checkpoint_seq`): the local one
        when usable (and `pull` is not asked for), else the repository's copy of it, pulled
        back. Never an older checkpoint, here or in the repository: resuming one would drop
        what the sandbox did since without a word, so `RestoreError` says so instead (the
        files stay as they are)."""
        sandbox_dir = self.sandboxes_dir / record.id
        seq = record.checkpoint_seq
        local: RestoreError | None = None
        if not pull:
            try:
                return await self.driver.load_saved(checkpoints.pause_dir(sandbox_dir, seq))
            except RestoreError as e:
                local = e
        archived = (self.catalog.get(record.id) or record).archived
        push = self._pushes.get(record.id)
        if push is not None:  # its upload is under way: the copy is about to exist
            await asyncio.gather(push, return_exceptions=True)
            current = self.catalog.get(record.id)
            archived = current.archived if current else None
        if self.archive is None or archived is None:
            if local is not None:  # why it is unusable (a corrupt file, a foreign format)
                raise local
            raise RestoreError(f"sandbox {record.id} has no usable checkpoint")
        if archived.seq != seq:
            raise RestoreError(
                f"sandbox {record.id}: its checkpoint {seq} is unusable, and the repository "
                f"holds only checkpoint {archived.seq}, an older state; not resuming that"
            )
        dest = checkpoints.archive_dir(sandbox_dir, seq)
        if self.lazy_pulls:
            log.info("sandbox %s: serving its checkpoint from the repository", record.id)
            snapshot, tree = await self.archive.pull_lazily(
                archived.manifest, dest, self.driver, self.lazy_prefetch
            )
            self.lazy.hold(record.id, tree)
            return snapshot
        log.warning("sandbox %s: pulling its checkpoint from the repository", record.id)
        return await self.archive.pull(archived.manifest, dest, self.driver)

    async def push_template(self, template: Template) -> None:
        """Upload a snapshot's directory; the template then names the copy. A memory file kept
        on tmpfs, outside the directory, goes into the copy too: the snapshot is exported into
        a staging directory beside it first (`archive.push_checkpoint`)."""
        if self.archive is None:
            return
        await self._push_template(template, self.archive)
        # `collect` keeps a template whose upload's staging is pinned: one deleted while it
        # uploaded goes now, not at some later sandbox's end.
        current = self.templates.by_id(template.template_id)
        if current is not None and current.deleted:
            await self.collect()

    async def _push_template(self, template: Template, archive: Archive) -> None:
        directory = Path(template.snapshot_dir)
        name = f"{template.kind}-{template.template_id}"
        metadata = {"template": template.template_id, "build": template.build_id}
        staging = directory.with_name(f"{directory.name}.upload")
        try:
            saved = await self.driver.load_saved(directory)
            await asyncio.to_thread(shutil.rmtree, staging, True)  # a crash's leftover
            # Pinned: `collect` would take the staged copy for a stale build of the template.
            with self.pin(staging):
                async with self._upload_slots:
                    if saved.memory_file is None or saved.memory_file.parent == directory:
                        manifest_id = await archive.push_snapshot(
                            directory, staging, name=name, metadata=metadata
                        )
                    else:
                        manifest_id = await archive.push_checkpoint(
                            saved, staging, self.driver, name=name, metadata=metadata
                        )
        except (OSError, RepositoryError, DriverError) as e:
            current = self.templates.by_id(template.template_id)
            if self._superseded(template) or (current is not None and current.deleted):
                log.info("upload of %s stopped: it was deleted meanwhile", template.template_id)
            else:
                log.warning("upload of %s failed: %s", template.template_id, e)
            return

        def with_manifest(current: Template) -> Template:
            if current.build_id != template.build_id:
                return current
            return dataclasses.replace(current, manifest_id=manifest_id)

        # Read and written at once: a change made meanwhile (an owner's PATCH) stays.
        stored = await asyncio.to_thread(self.templates.update, template.template_id, with_manifest)
        if stored is None or stored.manifest_id != manifest_id:
            await archive.drop(manifest_id)  # replaced or deleted meanwhile

    def _superseded(self, template: Template) -> bool:
        """Whether `template`'s build was removed or replaced by another."""
        current = self.templates.by_id(template.template_id)
        return current is None or current.build_id != template.build_id

    async def base_snapshot(self, template: Template) -> Snapshot:
        """The snapshot a template restores from, from the repository when its local files
        are gone: served as they are read on a node that pulls lazily (the caller ties the
        sandbox to `served_template`), pulled whole first otherwise."""
        directory = Path(template.snapshot_dir)
        if (served := self._usable_served(directory)) is not None:
            return served
        try:
            return await self._local(directory)
        except RestoreError as e:
            if self.archive is None or template.manifest_id is None:
                raise RestoreError(f"template {template.template_id} is unusable: {e}") from e
        async with self._pull_locks.setdefault(template.template_id, asyncio.Lock()):
            if (served := self._usable_served(directory)) is not None:
                return served
            with contextlib.suppress(RestoreError):
                return await self._local(directory)
            if self.lazy_pulls:
                # One whose background fetch failed: its VMs fault on what it lacks (SIGBUS,
                # never zeros) and end; the new copy replaces it.
                await self._end_served(str(directory))
                log.info("template %s: serving its files from the repository", template.template_id)
                snapshot, tree = await self.archive.pull_lazily(
                    template.manifest_id, directory, self.driver, self.lazy_prefetch
                )
                self._served[str(directory)] = (tree, snapshot)
                return snapshot
            log.warning("template %s: pulling its files from the repository", template.template_id)
            return await self.archive.pull(template.manifest_id, directory, self.driver)

    def served_template(self, template: Template) -> LazyTree | None:
        """The serving of `template`'s files, if this node served them lazily (whole by now
        or not)."""
        served = self._served.get(template.snapshot_dir)
        return None if served is None else served[0]

    def _usable_served(self, directory: Path) -> Snapshot | None:
        served = self._served.get(str(directory))
        return None if served is None or served[0].error is not None else served[1]

    async def _end_served(self, directory: str) -> None:
        served = self._served.pop(directory, None)
        if served is not None:
            await served[0].close()

    async def _local(self, directory: Path) -> Snapshot:
        """The saved state in `directory`; `RestoreError` when it is incomplete or another
        driver's (the repository's copy is the same: only files can be missing here)."""
        return await self.driver.load_saved(directory)

    async def drop_archived(self, record: SandboxRecord) -> None:
        if record.archived is not None:
            await self.drop(record.archived.manifest)
