"""Saved states made cheap to restore: guest memory moved out of the state file into a file.

Some drivers save a VM whose memory is a private mapping (a sandbox restored from a template)
with its memory inside the state file (`Snapshot.memory_file is None`), and every restore of such
a state then reads it all into fresh memory, which costs about twice a restore that maps a memory
file. `Detacher` has the driver turn such a state into the mapped kind without running the guest
(`Driver.detach_memory`), its state written into `<dir>/detached/` and its memory beside the
first form's files; restores then map that memory file like a template's. Pauses do it in the
background after they return; fork checkpoints and template builds before their first restore.
A state saved as the pages changed over a memory file needs no detach to restore quickly; a
finished template's is flattened all the same (`flatten`), so that its sandboxes share all of
its memory instead of each loading those pages. A state saved in memory layers over older
states (`Snapshot.layers`) has its chain merged into one state in the background once it is
`MERGE_DEPTH` deep (`merge`), written and adopted like a detached form; a fork checkpoint's
at once, before its children restore from it.

`adopt` switches a saved directory over to its detached form by atomically replacing its
`snapshot.json`: a crash before that leaves the first form in use (and `tidy` removes what the
detached form had written), a crash after it only leaves the replaced state file for `tidy`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import time
from pathlib import Path

from aenv.network import SlotProvider
from aenv.runtime.driver import (
    SNAPSHOT_MANIFEST,
    Driver,
    DriverError,
    NetAttachment,
    RestoreError,
    RestoreSpec,
    Snapshot,
    SnapshotTarget,
)

log = logging.getLogger("aenv.orchestrator")

DETACHED = "detached"
# A pause checkpoint lying over this many older states or more has them merged in the
# background (`Detacher.merge`), or by its resume if that comes first (which stops the
# background one), so restores compose few states and older pauses' states can go.
MERGE_DEPTH = 3


class Detacher:
    """`scratch` (a short path: VMM control sockets live there) and `memory_scratch` (tmpfs),
    both ours alone, hold the loading VMM's files while it works."""

    def __init__(
        self, driver: Driver, slots: SlotProvider, scratch: Path, memory_scratch: Path
    ) -> None:
        self.driver = driver
        self.slots = slots
        self.scratch = scratch
        self.memory_scratch = memory_scratch

    def sweep(self) -> None:
        """Remove what a crash left of earlier detaches."""
        for parent in (self.scratch, self.memory_scratch):
            shutil.rmtree(parent, ignore_errors=True)

    async def detach(
        self, snapshot: Snapshot, directory: Path, *, flatten: bool = False
    ) -> Snapshot | None:
        """The detached form of `snapshot` (saved in `directory`), written next to it but not
        adopted; None when there is nothing to do or it failed (the first form still works).
        With `flatten`, a state of changed pages over a memory file becomes one memory file
        too (`Driver.detach_memory`)."""
        if not snapshot.machine_state or (snapshot.memory_file is not None and not flatten):
            return None
        start = time.perf_counter()
        staging = directory / DETACHED
        run = secrets.token_hex(4)
        work, memory = self.scratch / run, self.memory_scratch / run
        slot = await self.slots.acquire(egress=False) if snapshot.spec.net else None
        net = NetAttachment(slot.netns, slot.guest.tap, slot.guest.mac) if slot else None
        async with contextlib.AsyncExitStack() as cleanup:
            if slot is not None:
                cleanup.push_async_callback(self.slots.release, slot)
            for scratch in (memory, work):
                cleanup.push_async_callback(asyncio.to_thread, shutil.rmtree, scratch, True)
            async with contextlib.AsyncExitStack() as undo:
                undo.push_async_callback(asyncio.to_thread, discard, directory)
                try:
                    await asyncio.to_thread(_fresh_dirs, staging, work, memory)
                    place = RestoreSpec(workdir=work, net=net, memory_dir=memory)
                    detached = await self.driver.detach_memory(
                        snapshot, SnapshotTarget(staging, directory), place, flatten=flatten
                    )
                except (DriverError, OSError) as e:
                    log.warning(
                        "could not detach the memory of %s (restores read it): %s", directory, e
                    )
                    return None
                if detached is snapshot:  # nothing to do; the undo removes the staging
                    return None
                undo.pop_all()
            log.info("detached the memory of %s in %.0f ms", directory, _ms_since(start))
            return detached

    async def merge(
        self, snapshot: Snapshot, directory: Path, depth: int = MERGE_DEPTH
    ) -> Snapshot | None:
        """The form of `snapshot` (saved in `directory`) whose memory layers are merged into
        one state (`Driver.merge_layers`), written into `directory/detached/` but not adopted
        (as a detached form: `adopt`, `discard` and `tidy` apply); None when its chain is
        shorter than `depth` or the merge failed (the layered form still works)."""
        if not snapshot.layers or len(snapshot.layers) < depth:
            return None
        start = time.perf_counter()
        staging = directory / DETACHED
        async with contextlib.AsyncExitStack() as undo:
            undo.push_async_callback(asyncio.to_thread, discard, directory)
            try:
                await asyncio.to_thread(_fresh_dirs, staging)
                merged = await self.driver.merge_layers(snapshot, staging)
            except (DriverError, OSError) as e:
                log.warning("could not merge the memory layers of %s: %s", directory, e)
                return None
            if merged is snapshot:  # the driver keeps no layers; the undo removes the staging
                return None
            undo.pop_all()
        log.info(
            "merged %d memory layers of %s in %.0f ms",
            len(snapshot.layers),
            directory,
            _ms_since(start),
        )
        return merged

    async def detach_in_place(
        self, snapshot: Snapshot, directory: Path, *, flatten: bool = False
    ) -> Snapshot:
        """Detach and adopt at once, for a directory nothing restores from yet. A memory file
        of the first form kept elsewhere (on tmpfs) goes too. A state in memory layers that is
        not flattened has them merged instead: each of its restores (a fork's children) would
        otherwise compose the chain again, in the server, while the others start."""
        if snapshot.layers and not flatten:
            merged = await self.merge(snapshot, directory, depth=1)
            if merged is None:
                return snapshot
            await asyncio.to_thread(adopt, directory, merged)
            return merged
        detached = await self.detach(snapshot, directory, flatten=flatten)
        if detached is None:
            return snapshot
        await asyncio.to_thread(adopt, directory, detached)
        replaced = snapshot.memory_file
        if replaced is not None and replaced != detached.memory_file:
            with contextlib.suppress(FileNotFoundError):
                await asyncio.to_thread(replaced.unlink)
        return detached


def adopt(directory: Path, detached: Snapshot) -> None:
    """Make `detached` the snapshot of `directory`, then free the state file it replaces."""
    detached.save_manifest(directory)
    _remove_unnamed(directory, detached)


def discard(directory: Path) -> None:
    """Remove a detached form that will not be adopted: `detached/` and the files next to it
    that the manifest in use does not name (its memory file, written beside)."""
    shutil.rmtree(directory / DETACHED, ignore_errors=True)
    try:
        current = Snapshot.load_manifest(directory)
    except RestoreError:
        return
    _remove_unnamed(directory, current)


def tidy(directory: Path) -> None:
    """After a crash: keep whichever form `snapshot.json` names and remove the other."""
    try:
        current = Snapshot.load_manifest(directory)
    except RestoreError:
        return
    if current.state_file.parent == directory / DETACHED:
        _remove_unnamed(directory, current)
    else:
        discard(directory)


def _remove_unnamed(directory: Path, current: Snapshot) -> None:
    """Remove the files directly in `directory` that `current` does not name: what is left of
    the form it replaced (its disks are shared by both forms and named)."""
    named = {
        current.state_file,
        *current.disks.values(),
        *current.layers,
        directory / SNAPSHOT_MANIFEST,
    }
    if current.memory_file is not None:
        named.add(current.memory_file)
    for entry in directory.iterdir():
        if entry.is_file() and entry not in named:
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()


def _fresh_dirs(*paths: Path) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000
