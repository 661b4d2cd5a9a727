"""The format-independent half of `Driver.export` and `Driver.load_saved`, shared by the drivers.

An exported saved state is a directory holding the state file (`state`), the memory file
(`memory`, when the guest memory is a file of its own; or in a memory directory of the caller's
choosing, on tmpfs, since restores map it), the older states the state lies over (`layer-1`,
..., when the driver saves memory in layers), one sealed image per writable drive (made by the
driver, in its format) and `snapshot.json`, written last: a directory without it never finished
exporting. State and memory files are never written again once saved, so an export that keeps
the source (`move=False`) hard-links them instead of copying.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path

from aenv.runtime.driver import IncompatibleSnapshotError, RestoreError, Snapshot
from aenv.storage import layers

STATE = "state"
MEMORY = "memory"
LAYER = "layer-"  # + 1, 2, ...: the older states the state lies over, oldest first

# Seals drive `drive_id`'s chain of layers, ending in `source`, as one image in the export
# directory and returns its path.
DiskExport = Callable[[str, Path], Awaitable[Path]]


async def export(
    snapshot: Snapshot,
    dest: Path,
    *,
    move: bool,
    disk: DiskExport,
    memory_dir: Path | None = None,
) -> Snapshot:
    """Fill `dest` (existing, empty) with `snapshot`'s state and memory (moved when `move`, else
    linked; the memory into `memory_dir` when given) and `disk`'s image of every writable drive;
    returns the exported snapshot. Raises `CorruptSavedState`, having placed nothing, when a file
    changed since the manifest beside it recorded it."""
    await asyncio.to_thread(_check_source, snapshot)
    state = dest / STATE
    await place(snapshot.state_file, state, move=move)
    memory = None
    if snapshot.memory_file is not None:
        memory = (memory_dir or dest) / MEMORY
        if snapshot.memory_file != memory:  # saved there already
            await place(snapshot.memory_file, memory, move=move)
    disks = {drive_id: await disk(drive_id, path) for drive_id, path in snapshot.disks.items()}
    layers = tuple(dest / f"{LAYER}{i}" for i in range(1, len(snapshot.layers) + 1))
    for src, layer in zip(snapshot.layers, layers, strict=True):
        if src != layer:  # exported there already
            # Linked even with `move`: the states a newer one lies over are their owners'.
            await place(src, layer, move=False)
    exported = dataclasses.replace(
        snapshot, state_file=state, memory_file=memory, disks=disks, layers=layers
    )
    await asyncio.to_thread(exported.save_manifest, dest)
    return exported


def _check_source(snapshot: Snapshot) -> None:
    """Compare `snapshot`'s files with the checksums its own manifest recorded, when the
    manifest beside its state file describes it: the export's manifest records the files as
    they are, so a change made since would otherwise become part of the saved state (of a
    repository copy, say). Blocking."""
    source = snapshot.state_file.parent
    try:
        recorded = Snapshot.load_manifest(source)
    except RestoreError:  # no manifest there, or another form's: nothing recorded to compare
        return
    if recorded.files() == snapshot.files():
        recorded.verify(source)


async def place(src: Path, dest: Path, *, move: bool) -> None:
    """`src`'s content at `dest`: renamed or hard-linked, copied when across filesystems."""
    try:
        await asyncio.to_thread(os.replace if move else os.link, src, dest)
        return
    except OSError:  # another filesystem
        await layers.sparse_copy(src, dest)
    if move:
        await asyncio.to_thread(src.unlink)


def load(directory: Path, driver: str, unread: Collection[Path] = ()) -> Snapshot:
    """The saved state in `directory`, if it is `driver`'s, every file it names is there and
    each has the checksum its manifest recorded (`CorruptSavedState` else). Blocking."""
    snapshot = Snapshot.load_manifest(directory)
    if snapshot.driver != driver:
        raise IncompatibleSnapshotError(
            f"the saved state in {directory} was made by {snapshot.driver}, not {driver}"
        )
    files = [snapshot.state_file, *snapshot.disks.values()]
    files += [d.path for d in snapshot.spec.disks if d.read_only]
    if snapshot.memory_file is not None:
        files.append(snapshot.memory_file)
    files += snapshot.layers
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise RestoreError(f"the saved state in {directory} lacks {', '.join(missing)}")
    snapshot.verify(directory, unread)
    return snapshot
