"""Disk layers: the template's read-only base, a private writable layer per sandbox, sealing.

The guest always sees two filesystems, merged by our init with overlayfs: the template base
(`aenv-root`, raw ext4, shared read-only by every sandbox of the template) and the sandbox's
writable layer (`aenv-upper`, ext4 holding only what the sandbox changed). That split is what makes
layering work on VMMs without a copy-on-write disk format (Firecracker): the writable layer is
small, so copying it is cheap. On the host the writable layer is itself a chain:

- QEMU: a qcow2 overlay on top of sealed (read-only) layers. Sealing is `blockdev-snapshot-sync`
  in the running VMM: the current top becomes read-only and the VM continues on a new, empty top,
  so a snapshot costs nothing proportional to disk size. Restores get a new qcow2 on the sealed top.
- raw (Firecracker): sealing is a sparse (or reflink) copy of the writable file; a restore gets its
  own sparse/reflink copy of the sealed file.

qcow2 chains grow by one per snapshot-of-a-restore; `flatten_if_deep` rewrites a sealed layer whose
chain is deeper than a limit into one standalone file, which keeps reads fast and lets old layers
be garbage-collected.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import zlib
from collections import OrderedDict
from pathlib import Path

from aenv.guest.cmdline import UPPER_LABEL
from aenv.guest.rootfs import make_ext4

QCOW2_MAGIC = b"QFI\xfb"
DEFAULT_UPPER_MIB = 2048
DEFAULT_MAX_DEPTH = 8
MAX_CHAIN = 64  # what a corrupt header that loops would otherwise make endless


class LayerError(RuntimeError):
    """A disk layer could not be created, sealed or flattened."""


async def _run(*argv: str | Path) -> str:
    proc = await asyncio.create_subprocess_exec(
        *[str(a) for a in argv],
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise LayerError(f"{argv[0]} failed ({proc.returncode}): {err.decode().strip()[-1000:]}")
    return out.decode()


def is_qcow2(path: Path) -> bool:
    with path.open("rb") as fh:
        return fh.read(4) == QCOW2_MAGIC


async def new_upper(dest: Path, size_mib: int = DEFAULT_UPPER_MIB) -> Path:
    """An empty writable layer: a sparse ext4 image that costs a few MiB until written."""
    return await make_ext4(None, dest, label=UPPER_LABEL, size_mib=size_mib)


async def qcow2_overlay(backing: Path, dest: Path) -> Path:
    """A new empty qcow2 top over `backing` (absolute path, recorded in the header).

    Every restore of a snapshot needs one over the same sealed layer, and `qemu-img create`
    writes the same bytes each time (nothing in an empty qcow2 is random), so the first one over
    a given layer is remembered and later ones are copies: ≈ 0.2 ms instead of ≈ 10 ms."""
    key = await asyncio.to_thread(_blank_key, backing)
    blank = _BLANKS.get(key)
    if blank is not None:
        _BLANKS.move_to_end(key)
        await asyncio.to_thread(dest.write_bytes, zlib.decompress(blank))
        return dest
    fmt = "qcow2" if await asyncio.to_thread(is_qcow2, backing) else "raw"
    await _run("qemu-img", "create", "-q", "-f", "qcow2", "-b", key[0], "-F", fmt, dest)
    _BLANKS[key] = zlib.compress(await asyncio.to_thread(dest.read_bytes))
    while len(_BLANKS) > _BLANKS_KEPT:
        _BLANKS.popitem(last=False)
    return dest


_BLANKS: OrderedDict[tuple[str, int, int, int], bytes] = OrderedDict()  # zlib-compressed, LRU
_BLANKS_KEPT = 256


def _blank_key(backing: Path) -> tuple[str, int, int, int]:
    absolute = backing.resolve()
    st = absolute.stat()  # sealed layers never change; a replaced file is another key
    return str(absolute), st.st_ino, st.st_size, st.st_mtime_ns


async def sparse_copy(src: Path, dest: Path) -> Path:
    """Copy a raw layer, sharing extents where the filesystem can (reflink) and skipping holes."""
    await _run("cp", "--reflink=auto", "--sparse=always", src, dest)
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


def chain(path: Path) -> list[Path]:
    """The backing chain of `path`, top first (a raw file is a chain of one). Read from the
    qcow2 headers directly (backing file offset and length at bytes 8 and 16, big-endian): a
    `qemu-img info` per pause cost more than the rest of the disk work."""
    found = [path]
    while len(found) <= MAX_CHAIN:
        with found[-1].open("rb") as fh:
            header = fh.read(20)
            if header[:4] != QCOW2_MAGIC:
                return found
            offset, length = struct.unpack(">QI", header[8:20])
            if offset == 0:
                return found
            fh.seek(offset)
            backing = Path(fh.read(length).decode())
        found.append(backing if backing.is_absolute() else found[-1].parent / backing)
    raise LayerError(f"the backing chain of {path} is longer than {MAX_CHAIN}")


async def flatten_if_deep(path: Path, max_depth: int = DEFAULT_MAX_DEPTH) -> Path:
    """If `path`'s chain is deeper than `max_depth`, replace `path` with a standalone copy of the
    whole chain (same name, so references stay valid). Only for sealed, unused-by-writers layers."""
    if len(await asyncio.to_thread(chain, path)) <= max_depth:
        return path
    tmp = path.with_name(path.name + ".flat")
    try:
        await _run("qemu-img", "convert", "-q", "-O", "qcow2", path, tmp)
        await asyncio.to_thread(tmp.chmod, 0o444)
        await asyncio.to_thread(os.replace, tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return path


async def flatten_to(src: Path, dest: Path) -> Path:
    """A standalone, read-only copy of `src`'s whole chain at `dest` (nothing below it is needed
    any more). `src` may be in use as a backing layer by a running VM: it is only read."""
    await _run("qemu-img", "convert", "-q", "-U", "-O", "qcow2", src, dest)
    await asyncio.to_thread(dest.chmod, 0o444)
    return dest


def allocated_bytes(path: Path) -> int:
    """Bytes a (sparse) layer file actually occupies on the host."""
    return path.stat().st_blocks * 512
