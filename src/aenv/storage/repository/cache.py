"""`ChunkCache`: the node-local chunk cache, bounded in bytes, least recently used out first.

It holds chunks as stored (compressed), one file per chunk under its directory, so a restore
reads from the store only what this node lacks, and chunks a node uploads are cached on the way
(a sandbox paused here is most often resumed here). The byte bound counts the chunk files'
sizes. Recency lives in memory and in each file's mtime, which every put and hit sets
explicitly (the kernel's own timestamps are only as fine as its timer tick), so a restarted node
starts with its cache and its order. Entries are not trusted: the repository
verifies every chunk it reads from here and `discard`s a bad one (a torn write after a crash, a
flipped bit), then fetches it from the store. One process owns a cache directory.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

TEMP_DIR = ".tmp"


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    used_bytes: int = 0
    entries: int = 0


class ChunkCache:
    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, int] = OrderedDict()  # digest -> size, oldest first
        self._stats = CacheStats()
        self._clock = 0
        self._temp = directory / TEMP_DIR
        self._temp.mkdir(parents=True, exist_ok=True)
        for entry in os.scandir(self._temp):  # writes a crash interrupted
            os.unlink(entry.path)
        found: list[tuple[float, str, int]] = []
        for sub in os.scandir(directory):
            if sub.name == TEMP_DIR or not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                st = entry.stat()
                found.append((st.st_mtime_ns, entry.name, st.st_size))
        for _, digest, size in sorted(found):
            self._entries[digest] = size
            self._stats.used_bytes += size
        for victim in self._evict():  # the bound may have shrunk since the last run
            self._path(victim).unlink(missing_ok=True)

    @property
    def stats(self) -> CacheStats:
        with self._lock:
            return replace(self._stats, entries=len(self._entries))

    def _path(self, digest: str) -> Path:
        return self.directory / digest[:2] / digest

    def __contains__(self, digest: object) -> bool:
        with self._lock:
            return digest in self._entries

    def get(self, digest: str) -> bytes | None:
        """The cached chunk, or None; a hit makes it the most recently used."""
        with self._lock:
            known = digest in self._entries
            if known:
                self._entries.move_to_end(digest)
        if known:
            path = self._path(digest)
            try:
                data = path.read_bytes()
                self._touch(path)
            except FileNotFoundError:  # evicted since the lookup, or lost by a race with it
                data = None
            if data is not None:
                with self._lock:
                    self._stats.hits += 1
                return data
            self._forget(digest)
        with self._lock:
            self._stats.misses += 1
        return None

    def put(self, digest: str, data: bytes) -> None:
        """Cache a chunk (no-op if present or larger than the whole cache)."""
        size = len(data)
        with self._lock:
            if digest in self._entries or size > self.max_bytes:
                return
        path = self._path(digest)
        temp = self._temp / f"{digest}.{secrets.token_hex(4)}"
        # No fsync: a chunk torn by a crash fails verification and is fetched again.
        temp.write_bytes(data)
        self._touch(temp)
        path.parent.mkdir(exist_ok=True)
        os.replace(temp, path)
        with self._lock:
            if digest in self._entries:  # another thread cached it meanwhile
                return
            self._entries[digest] = size
            self._stats.used_bytes += size
            victims = self._evict()
        for victim in victims:
            self._path(victim).unlink(missing_ok=True)

    def _touch(self, path: Path) -> None:
        """Mark `path` most recently used on disk: a strictly increasing mtime."""
        with self._lock:
            self._clock = max(time.time_ns(), self._clock + 1)
            stamp = self._clock
        os.utime(path, ns=(stamp, stamp))

    def discard(self, digest: str) -> None:
        """Drop an entry that failed verification."""
        self._forget(digest)
        self._path(digest).unlink(missing_ok=True)

    def _forget(self, digest: str) -> None:
        with self._lock:
            size = self._entries.pop(digest, None)
            if size is not None:
                self._stats.used_bytes -= size

    def _evict(self) -> list[str]:
        """Drop least recently used entries until the rest fits; the caller unlinks them."""
        victims: list[str] = []
        while self._entries and self._stats.used_bytes > self.max_bytes:
            digest, size = self._entries.popitem(last=False)
            self._stats.used_bytes -= size
            self._stats.evictions += 1
            victims.append(digest)
        return victims
