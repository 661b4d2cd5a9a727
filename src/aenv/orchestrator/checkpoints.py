"""Saved sandbox states on disk: pause checkpoints and self-contained exports.

A sandbox's directory (`sandboxes/<id>/`) is the work dir of every VM it runs in. Each pause
writes a checkpoint `pause-<n>/` there (device state, memory, sealed disk layers, `snapshot.json`
last: a checkpoint without it never completed and is ignored); its memory may later be detached
into a file (`detach.py`). A driver may save only the memory the guest changed over the memory
file it was restored from (`runtime/ramdelta.py`): that file, a template's or an older
checkpoint's, is then the checkpoint's `memory_file` and stays while the checkpoint does; and
it may save only what changed since the states it was restored from, as a layer over them
(`Snapshot.layers`: older checkpoints' states, or a snapshot's), which stay as long too (an
older checkpoint's manifest stays while it names one; a merge of the chain frees them,
`detach.Detacher.merge`).
A driver's sealed disk layers may stack on the previous checkpoint's (or the template's) by
absolute path, so they stay until the sandbox is killed; only the state and memory of
checkpoints older than the newest are removed.

Snapshots and fork checkpoints outlive the sandbox they came from, so they are *exported*
(`Driver.export`): a directory that depends on nothing of the sandbox any more, and a memory
file on tmpfs beside the templates' (`TemplateStore.build_memory_dir`; for a sandbox restored
from a memory file, a hard link to that file, with the pages it changed in the state).
"""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path

from aenv.orchestrator import detach
from aenv.runtime.driver import SNAPSHOT_MANIFEST, RestoreError, Snapshot

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
    be below `keep`'s and stay, and so do an older memory file and the older states that
    `keep`'s changed pages lie over), and remove those after it: a crash left them incomplete."""
    kept = pause_dir(sandbox_dir, keep)
    detach.tidy(kept)
    try:
        snapshot = Snapshot.load_manifest(kept)
        needed = {*snapshot.layers, *filter(None, [snapshot.memory_file])}
    except RestoreError:
        needed = set()
    for entry in sandbox_dir.glob("pause-*"):
        match = _PAUSE.match(entry.name)
        if not match or int(match.group(1)) == keep:
            continue
        if int(match.group(1)) > keep:
            shutil.rmtree(entry, ignore_errors=True)
        else:
            _free(entry, needed)


def _free(checkpoint: Path, needed: set[Path]) -> None:
    """Remove a checkpoint's state and memory (but those in `needed`, which a newer checkpoint
    lies over), keeping its disk layers. The manifest goes last, and stays while it names a
    needed file, so that a later prune (or one after a crash in between) can free it."""
    detach.tidy(checkpoint)
    try:
        snapshot = Snapshot.load_manifest(checkpoint)
    except RestoreError:
        return  # freed before
    files = (snapshot.state_file, snapshot.memory_file)
    own = {p for p in files if p is not None and checkpoint in p.parents}
    for path in own - needed:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    if own & needed:
        return  # the manifest stays: it names what a newer checkpoint needs
    detach.discard(checkpoint)
    with contextlib.suppress(FileNotFoundError):
        (checkpoint / SNAPSHOT_MANIFEST).unlink()
