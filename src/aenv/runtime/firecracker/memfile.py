"""Guest memory files of Firecracker snapshots: turning a diff snapshot into a full one.

A `Diff` snapshot's memory file is sparse: it holds only the pages written since the VM was
booted, restored or last snapshotted, at their guest offsets, and holes elsewhere. The diff of a
freshly booted VM is complete by itself (untouched guest memory is zeros, which is what a hole
reads as). The diff of a restored VM must be laid over the memory it was restored from: copy the
base (sparse, reflinked where the filesystem can: `aenv.storage.layers.sparse_copy`), then write
the diff's data extents onto the copy at the same offsets (what Firecracker's `snapshot-editor
edit-memory rebase` does), so the cost follows the pages the guest dirtied.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from aenv.storage import layers


class MemoryFileError(RuntimeError):
    """A diff memory file could not be merged."""


def data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of every data region of the open file, skipping holes."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data after offset
                return
            raise
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, end - start
        offset = end


async def merge_diff(diff: Path, base: Path, destination: Path) -> None:
    """Write `base` overlaid with the data extents of `diff` to `destination`, which is
    replaced atomically, so a failure leaves no half file."""
    partial = destination.with_name(destination.name + ".partial")
    with contextlib.ExitStack() as undo:
        undo.callback(partial.unlink, missing_ok=True)  # made even if the copy fails
        await layers.sparse_copy(base, partial)
        await asyncio.to_thread(_overlay, diff, partial)
        partial.replace(destination)
        undo.pop_all()


def _overlay(diff: Path, target: Path) -> None:
    with diff.open("rb") as src, target.open("r+b") as dst:
        size = os.fstat(src.fileno()).st_size
        if size > os.fstat(dst.fileno()).st_size:
            raise MemoryFileError(f"diff {diff} is larger than its base")
        for offset, length in data_extents(src.fileno(), size):
            _copy_range(src.fileno(), dst.fileno(), offset, length)


_CHUNK = 1 << 20


def _copy_range(src: int, dst: int, offset: int, length: int) -> None:
    done = 0
    while done < length:
        pos = offset + done
        try:
            n = os.copy_file_range(src, dst, length - done, pos, pos)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            # Files on different filesystems (or one without copy_file_range): plain copy.
            chunk = os.pread(src, min(_CHUNK, length - done), pos)
            n = os.pwrite(dst, chunk, pos) if chunk else 0
        if n == 0:
            raise MemoryFileError("diff memory file shrank while merging")
        done += n
