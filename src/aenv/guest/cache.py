"""A build cache for guest artifacts: one directory per (name, inputs) key, built at most once.

Builds run in a temporary sibling directory and are renamed into place, so a crash never leaves
a half-built entry that looks complete; a file lock keeps concurrent builders of one key apart.
A cache on a read-only filesystem (one node fills it, others share it) is read without locks:
an entry it lacks is a `CacheReadOnly` error, not a build.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

from aenv import mounts
from aenv.config import ConfigError


class CacheReadOnly(ConfigError):
    """A read-only guest cache lacks an entry this node needs; nothing was written."""

    def __init__(self, root: Path, what: str) -> None:
        super().__init__(
            f"the guest cache {root} is read-only and holds no {what} for this version: fill it "
            "where it is writable (start one node with guest_cache set to it there)"
        )


def read_only(root: Path) -> bool:
    """Whether `root` exists on a filesystem this process cannot write (access(2) says EROFS
    even to root)."""
    return root.is_dir() and not os.access(root, os.W_OK)


def cache_key(inputs: object) -> str:
    blob = json.dumps(inputs, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


async def cached_dir(
    name: str, inputs: object, build: Callable[[Path], Awaitable[None]], root: Path
) -> Path:
    """Return the cache entry for `inputs` under `root` (the configured guest cache, see
    `config.Paths.guest_cache`), calling `build(tmpdir)` to create it if missing."""
    base = root
    base.mkdir(parents=True, exist_ok=True)
    final = base / f"{name}-{cache_key(inputs)}"
    if final.is_dir():
        return final
    if read_only(base):
        raise CacheReadOnly(base, name)
    lock_path = base / f".{final.name}.lock"
    fd = await asyncio.to_thread(_lock, lock_path)
    try:
        if final.is_dir():
            return final
        # Builds of this entry that died (the lock is ours, so none runs): their trees go.
        for stale in base.glob(f".{final.name}.tmp-*"):
            await asyncio.to_thread(_remove, stale)
        tmp = base / f".{final.name}.tmp-{os.getpid()}"
        tmp.mkdir()
        try:
            await build(tmp)
            (tmp / "inputs.json").write_text(json.dumps(inputs, sort_keys=True, default=str))
            tmp.rename(final)
        except BaseException:
            await asyncio.to_thread(_remove, tmp)
            raise
        return final
    finally:
        os.close(fd)


def _remove(tree: Path) -> None:
    """Delete a build's tree, unmounting first what a build cut short left mounted in it
    (debootstrap mounts /proc and /sys in its target and, killed, leaves them): deleting
    through a mount would reach the host's files."""
    mounts.unmount_under(tree.resolve())
    shutil.rmtree(tree, ignore_errors=True)


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd
