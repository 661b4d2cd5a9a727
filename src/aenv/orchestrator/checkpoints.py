"""Saved sandbox states on disk: pause checkpoints and self-contained exports.

A sandbox's directory (`sandboxes/<id>/`) is the work dir of every VM it runs in. Each pause
writes a checkpoint `pause-<n>/` there (device state with memory, sealed disk layers,
`snapshot.json` last: a checkpoint without it never completed and is ignored); its memory may
later be detached into a file (`detach.py`). A checkpoint's
disk layers are qcow2 files stacked on the previous checkpoint's (or the template's) by absolute
path, so they stay until the sandbox is killed; only the state and memory of checkpoints older
than the newest are removed.

Snapshots and fork checkpoints outlive the sandbox they came from, so they are *exported*: state
and memory moved or hard-linked, every writable disk chain flattened into one standalone image.
Such a directory depends on nothing of the sandbox any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import shutil
from pathlib import Path

from aenv.orchestrator import detach
from aenv.runtime.driver import SNAPSHOT_MANIFEST, RestoreError, Snapshot
from aenv.storage import layers

_PAUSE = re.compile(r"^pause-(\d+)$")


def pause_dir(sandbox_dir: Path, seq: int) -> Path:
    return sandbox_dir / f"pause-{seq}"


def staging_dir(sandbox_dir: Path, seq: int) -> Path:
    """Where a snapshot of a running sandbox seals its layers (the running VM stacks on them)."""
    return sandbox_dir / f"layers-{seq}"


def archive_dir(sandbox_dir: Path, seq: int) -> Path:
    """Where checkpoint `seq` is exported for upload to the repository, and pulled back to."""
    return sandbox_dir / f"archive-{seq}"


def latest_pause(sandbox_dir: Path) -> tuple[int, Snapshot] | None:
    """The newest complete pause checkpoint (a crash mid-pause leaves an incomplete newer one,
    which does not count)."""
    found: list[tuple[int, Path]] = []
    for entry in sandbox_dir.glob("pause-*"):
        match = _PAUSE.match(entry.name)
        if match and (entry / SNAPSHOT_MANIFEST).is_file():
            found.append((int(match.group(1)), entry))
    for seq, path in sorted(found, reverse=True):
        try:
            return seq, Snapshot.load_manifest(path)
        except RestoreError:
            continue
    return None


def prune_pauses(sandbox_dir: Path, keep: int) -> None:
    """Free the state and memory of the checkpoints before `keep` (their disk layers may still
    be below `keep`'s and stay), and remove those after it: a crash left them incomplete."""
    for entry in sandbox_dir.glob("pause-*"):
        match = _PAUSE.match(entry.name)
        if not match:
            continue
        if int(match.group(1)) == keep:
            detach.tidy(entry)
            continue
        if int(match.group(1)) > keep:
            shutil.rmtree(entry, ignore_errors=True)
            continue
        detach.discard(entry)
        for name in ("state", SNAPSHOT_MANIFEST):
            with contextlib.suppress(FileNotFoundError):
                (entry / name).unlink()


async def export(snapshot: Snapshot, dest: Path, *, move: bool) -> Snapshot:
    """Make `dest` (existing, empty) a self-contained copy of `snapshot`. `move` takes the state
    and memory files over (they must then belong to nobody else); otherwise they are
    hard-linked, which is free and safe because saved files are never written again."""
    place = _move if move else _link

    state = dest / "state"
    await place(snapshot.state_file, state)
    memory = None
    if snapshot.memory_file is not None:
        memory = dest / "memory"
        await place(snapshot.memory_file, memory)
    disks: dict[str, Path] = {}
    for drive_id, path in snapshot.disks.items():
        disks[drive_id] = await layers.flatten_to(path, dest / f"{drive_id}.qcow2")
    exported = dataclasses.replace(snapshot, state_file=state, memory_file=memory, disks=disks)
    await asyncio.to_thread(exported.save_manifest)
    return exported


async def _move(src: Path, dest: Path) -> None:
    try:
        await asyncio.to_thread(os.replace, src, dest)
    except OSError:  # another filesystem
        await layers.sparse_copy(src, dest)
        await asyncio.to_thread(src.unlink)


async def _link(src: Path, dest: Path) -> None:
    try:
        await asyncio.to_thread(os.link, src, dest)
    except OSError:
        await layers.sparse_copy(src, dest)
