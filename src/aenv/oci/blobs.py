"""The local content-addressed blob cache shared by every pull: `<root>/sha256/<hex>`.

A blob only appears under its digest once its bytes were hashed and matched, so a cached blob
is trusted without rehashing. Downloads grow `<hex>.partial` and resume from its length; a lock
on the partial file keeps two pulls (or two processes) from writing the same blob at once.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from aenv.oci.errors import ImageError

_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")


class DigestMismatchError(ImageError):
    """Bytes from the registry do not hash to the digest they were asked for."""

    def __init__(self, what: str, expected: str, actual: str) -> None:
        super().__init__(f"{what}: digest mismatch: expected {expected}, got {actual}")
        self.expected = expected
        self.actual = actual


def hex_of(digest: str) -> str:
    """The hex part of a sha256 digest; anything else is refused (it also names a file)."""
    m = _DIGEST.match(digest)
    if m is None:
        raise ImageError(f"unsupported digest {digest!r} (sha256 only)")
    return m.group(1)


def sha256_digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


@dataclass
class PartialBlob:
    """An open, locked `.partial` file: `offset` bytes are already there and hashed."""

    file: BinaryIO
    offset: int
    hasher: hashlib._Hash = field(default_factory=hashlib.sha256)

    def write(self, chunk: bytes) -> None:
        self.file.write(chunk)
        self.hasher.update(chunk)
        self.offset += len(chunk)

    def restart(self) -> None:
        """The server ignored our Range: start the blob over."""
        self.file.seek(0)
        self.file.truncate()
        self.offset = 0
        self.hasher = hashlib.sha256()


class BlobCache:
    def __init__(self, root: Path) -> None:
        self.root = root / "sha256"

    def path(self, digest: str) -> Path:
        return self.root / hex_of(digest)

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    @asynccontextmanager
    async def partial(self, digest: str) -> AsyncIterator[PartialBlob | None]:
        """Locked partial file for `digest`, or None if the blob is (by now) complete. The caller
        writes, then `commit`s; the partial is kept on a network error so a later pull resumes,
        and dropped on a digest mismatch."""
        if self.has(digest):
            yield None
            return
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"{hex_of(digest)}.partial"
        file = await _open_locked(path)
        try:
            if self.has(digest):  # another pull finished it while we waited for the lock
                path.unlink(missing_ok=True)
                yield None
                return
            hasher = await asyncio.to_thread(_hash_file, file)
            yield PartialBlob(file, file.tell(), hasher)
        finally:
            file.close()

    def commit(self, digest: str, blob: PartialBlob) -> Path:
        """Verify and move into place; a mismatch removes the partial (its bytes are wrong)."""
        actual = f"sha256:{blob.hasher.hexdigest()}"
        partial = self.root / f"{hex_of(digest)}.partial"
        if actual != digest:
            partial.unlink(missing_ok=True)
            raise DigestMismatchError(f"blob {digest}", digest, actual)
        blob.file.flush()
        os.fsync(blob.file.fileno())
        final = self.path(digest)
        os.replace(partial, final)
        return final


async def _open_locked(path: Path) -> BinaryIO:
    """`path` opened and exclusively locked. The holder before us may have renamed or removed
    the file it locked: then ours is a stale inode and we open the path again."""
    while True:
        file = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+b")
        try:
            # flock blocks the thread; poll without blocking so the event loop keeps running.
            while True:
                try:
                    fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(0.1)
            try:
                if os.stat(path).st_ino == os.fstat(file.fileno()).st_ino:
                    return file
            except FileNotFoundError:
                pass
        except BaseException:
            file.close()
            raise
        file.close()


def _hash_file(file: BinaryIO) -> hashlib._Hash:
    hasher = hashlib.sha256()
    file.seek(0)
    while chunk := file.read(1 << 20):
        hasher.update(chunk)
    return hasher
