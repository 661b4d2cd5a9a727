"""A VM's drives as qcow2 layers: fresh writable tops over a saved state's sealed layers, sealing
a drive's top into a snapshot, stacking a new top over it in the running VMM; and removing the
files a VM made."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path

from aenv.runtime import qcow2
from aenv.runtime.driver import Disk, Snapshot
from aenv.runtime.qmp import Monitor, MonitorError
from aenv.storage import layers


async def writable_tops(
    snapshot: Snapshot, workdir: Path, tag: str, undo: contextlib.ExitStack
) -> tuple[list[Disk], list[Path]]:
    """`snapshot`'s drives for a new VM: shared read-only drives as they are, and a fresh qcow2
    top in `workdir` over each sealed writable layer. Returns the drives and the tops made; the
    removal of each top is pushed onto `undo` as soon as it is made."""
    drives: list[Disk] = []
    created: list[Path] = []
    for disk in snapshot.spec.disks:
        if disk.read_only:
            drives.append(disk)
            continue
        top = workdir / f"{disk.drive_id}.{tag}.qcow2"
        await qcow2.overlay(snapshot.disks[disk.drive_id], top)
        undo.callback(unlink, [top])
        created.append(top)
        drives.append(Disk(disk.drive_id, top))
    return drives, created


async def seal(disk: Disk, directory: Path, made: list[Path]) -> Path:
    """Give the drive's current top its permanent name in the snapshot directory. Layers are
    only ever referenced by such names, never by a VM's workdir, which goes away with it."""
    ext = "qcow2" if await asyncio.to_thread(qcow2.is_qcow2, disk.path) else "img"
    dest = directory / f"{disk.drive_id}.{ext}"
    made.append(dest)
    return await layers.seal(disk.path, dest)


async def stack(
    monitor: Monitor, drive_id: str, node: str, top: Path, options: dict[str, str]
) -> None:
    """Put `top` over the drive's current top, which becomes its backing layer. Added as a
    node of its own first (not `blockdev-snapshot-sync`, whose new node gets default options):
    the new top must pass discards and unmap zeros (`options`) as the drive's first one does.
    Its header is left as we wrote it, naming the sealed layer."""
    await monitor.execute(
        "blockdev-add",
        **{
            "driver": "qcow2",
            "node-name": node,
            "file": {"driver": "file", "filename": str(top)},
            "backing": None,  # the drive's current top, given by blockdev-snapshot
            **options,
        },
    )
    try:
        await monitor.execute("blockdev-snapshot", node=drive_id, overlay=node)
    except MonitorError:
        with contextlib.suppress(MonitorError):
            await monitor.execute("blockdev-del", **{"node-name": node})
        raise


def unlink(paths: Sequence[Path]) -> None:
    """Remove files a VM made; those already gone are skipped."""
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
