"""`PosixStore`: the blob store as a directory tree (the default, inside the data dir).

Keys map to paths below the root. Writes go to a temporary file in `<root>/.tmp`, which is
fsynced, renamed over the final path and followed by an fsync of the directory: the rename makes
the write atomic, the two fsyncs make it durable before `put` returns, which is what lets the
repository order "chunks, then the manifest that names them" across a crash. A crash between
write and rename leaves a temporary file behind; those older than a day are removed when a store
is opened (younger ones may belong to another process writing right now).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

from aenv.storage.repository.errors import BlobNotFound
from aenv.storage.repository.store import BlobInfo

TEMP_DIR = ".tmp"
STALE_TEMP_SECONDS = 24 * 3600


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PosixStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._temp = root / TEMP_DIR
        self._temp.mkdir(parents=True, exist_ok=True)
        cutoff = time.time() - STALE_TEMP_SECONDS
        for entry in os.scandir(self._temp):
            with contextlib.suppress(FileNotFoundError):
                if entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)

    def _path(self, key: str) -> Path:
        # Dot names are reserved for the store (`.tmp`) and rule out `.`/`..` escapes.
        parts = key.split("/")
        if not key or any(not p or p.startswith(".") for p in parts):
            raise ValueError(f"invalid key {key!r}")
        return self.root.joinpath(*parts)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        temp = self._temp / f"{path.name}.{secrets.token_hex(8)}"
        try:
            with temp.open("wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.replace(temp, path)
            except FileNotFoundError:
                path.parent.mkdir(parents=True, exist_ok=True)
                os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise BlobNotFound(key) from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def list(self, prefix: str) -> Iterator[BlobInfo]:
        # Walk only the directory the prefix names; its last part filters entry names.
        directory, _, stem = prefix.rpartition("/")
        start = self._path(directory) if directory else self.root
        yield from self._walk(start, directory, stem)

    def _walk(self, path: Path, key_dir: str, stem: str) -> Iterator[BlobInfo]:
        try:
            entries = list(os.scandir(path))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            if entry.name.startswith(".") or not entry.name.startswith(stem):
                continue
            key = f"{key_dir}/{entry.name}" if key_dir else entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    yield from self._walk(Path(entry.path), key, "")
                else:
                    st = entry.stat(follow_symlinks=False)
                    yield BlobInfo(key, st.st_size, st.st_mtime)
            except FileNotFoundError:  # deleted while listing
                continue
