"""Disk layers: the template's read-only base, a private writable layer per sandbox, sealing.

The guest always sees two filesystems, merged by our init with overlayfs: the template base
(`aenv-root`, raw ext4, shared read-only by every sandbox of the template) and the sandbox's
writable layer (`aenv-upper`, ext4 holding only what the sandbox changed). That split is what makes
layering work on VMMs without a copy-on-write disk format (Firecracker): the writable layer is
small, so copying it is cheap. On the host the writable layer is itself a chain whose format each
driver chooses (`aenv.runtime`); this module holds what is the same for all: the empty upper
image, sparse or reflinked copies, sealing a finished layer under its permanent name, and how much
of the host's disk a layer occupies.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from aenv.guest.cmdline import UPPER_LABEL
from aenv.guest.rootfs import make_ext4
from aenv.subprocesses import tied

DEFAULT_UPPER_MIB = 2048


class LayerError(RuntimeError):
    """A disk layer could not be created, sealed or flattened."""


async def run_tool(*argv: str | Path) -> str:
    """Run a disk tool; its stdout, or `LayerError` with the end of its stderr."""
    proc = await asyncio.create_subprocess_exec(
        *tied(argv),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise LayerError(f"{argv[0]} failed ({proc.returncode}): {err.decode().strip()[-1000:]}")
    return out.decode()


async def new_upper(dest: Path, size_mib: int = DEFAULT_UPPER_MIB) -> Path:
    """An empty writable layer: a sparse ext4 image that costs a few MiB until written."""
    return await make_ext4(None, dest, label=UPPER_LABEL, size_mib=size_mib)


async def sparse_copy(src: Path, dest: Path) -> Path:
    """Copy a raw layer, sharing extents where the filesystem can (reflink) and skipping holes."""
    await run_tool("cp", "--reflink=auto", "--sparse=always", src, dest)
    return dest


async def seal(src: Path, dest: Path) -> Path:
    """Give an immutable layer its permanent name: a hard link when on the same filesystem (no
    data moves, the VMM's open file is untouched), else a sparse copy. Made read-only."""
    try:
        await asyncio.to_thread(os.link, src, dest)
    except OSError:
        await sparse_copy(src, dest)
    await asyncio.to_thread(dest.chmod, 0o444)
    return dest


def allocated_bytes(path: Path) -> int:
    """Bytes a (sparse) layer file actually occupies on the host."""
    return path.stat().st_blocks * 512
