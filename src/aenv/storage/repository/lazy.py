"""`LazyFile`: one file of a stored manifest, materialised chunk by chunk as it is read.

A disk image or memory file restored lazily is a sparse local file that starts empty. A read
of a range first fills the chunks it overlaps, from the repository's sources (this node's
cache, the peers, the store; each chunk checked against its digest), then reads the local
file. Each chunk is fetched once however many readers want it at once; holes (all-zero chunks)
need no fetch. `complete` fills the rest in the background, first in a given order (`touched`:
the order chunks were first read, recorded for the file's next restore to prefetch), so the file
becomes whole without waiting for reads; `whole` says when it is.

Reads come first. A read fetches what it needs at once, not behind any queue; the chunks of the
given order (those the reads are expected to need next) come `prefetch` at a time, so a reader
that goes through them in turn (a VMM loading its saved state faults its memory in ascending
order, one fault at a time) finds most of them fetched or under way; the rest comes
`BACKGROUND` at a time, and a background worker starts no new chunk while a read waits: the
sources' time goes to the chunk a guest is stopped on.

The peers are looked up once for the file's reads (one session, as a pull has: a peer that
fails is left out for the rest), not once a chunk: that lookup is two round trips to Redis,
which a chunk from the node's own cache would wait for. A chunk that no source gives is asked
for again, the sources looked up afresh each time (a peer that failed may be back; a new holder
may have appeared), until `patience` seconds have passed; then the read raises
`UnreachableChunk`. A reader never gets zeros or stale bytes in place of a chunk's: what the
local file holds is exactly the chunks marked present.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from aenv.storage.repository.chunks import write_sparse
from aenv.storage.repository.errors import UnreachableChunk
from aenv.storage.repository.manifest import FileEntry, Manifest
from aenv.storage.repository.repository import Repository
from aenv.storage.repository.sources import PeerSession

log = logging.getLogger("aenv.repository")

# How long a read waits for a chunk no source gives before it fails, and the pause between asks.
PATIENCE = 60.0
RETRY_PAUSE = 0.5
# Chunks `complete` fetches at once beyond its order: reads still find room in the repository's
# pool.
BACKGROUND = 2


class LazyFile:
    def __init__(
        self,
        repository: Repository,
        manifest: Manifest,
        entry: FileEntry,
        path: Path,
        *,
        patience: float = PATIENCE,
    ) -> None:
        """Materialise `entry` of `manifest` at `path`, which is created empty (all holes)."""
        self.repository = repository
        self.manifest = manifest
        self.entry = entry
        self.path = path
        self.patience = patience
        self.touched: list[int] = []  # chunk indices in the order reads first needed them
        self.waited = 0  # chunks a read found missing and waited for
        self._seen: set[int] = set()
        self._present = [digest is None for digest in entry.chunks]
        self._fetching: dict[int, asyncio.Task[None]] = {}
        self._session: PeerSession | None = None
        self._session_lock = asyncio.Lock()
        self._reading = 0  # reads waiting for chunks
        self._no_reads = asyncio.Event()
        self._no_reads.set()
        with path.open("xb") as fh:
            fh.truncate(entry.size)

    @property
    def size(self) -> int:
        return self.entry.size

    @property
    def whole(self) -> bool:
        return all(self._present)

    def close(self) -> None:
        """Stop the fetches under way. The file stays (its owner removes it); a write a fetch
        has begun may still land in it."""
        for task in self._fetching.values():
            task.cancel()

    async def read(self, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` (short at the end of the file); raises `ChunkError` when
        a chunk they need cannot be had (`UnreachableChunk`: no source within `patience`)."""
        if offset < 0 or length < 0:
            raise ValueError(f"read of {length} bytes at {offset}")
        end = min(offset + length, self.size)
        if end <= offset:
            return b""
        size = self.manifest.chunk_size
        needed = range(offset // size, -(-end // size))
        self._touch(needed)
        if not all(self._present[i] for i in needed):
            self.waited += sum(1 for i in needed if not self._present[i])
            self._reading += 1
            self._no_reads.clear()
            try:
                await asyncio.gather(*(self._ensure(i) for i in needed))
            finally:
                self._reading -= 1
                if self._reading == 0:
                    self._no_reads.set()
        return await asyncio.to_thread(_pread, self.path, end - offset, offset)

    def read_present(self, offset: int, length: int) -> bytes | None:
        """As `read`, from any thread and at once, when every chunk the range needs is local
        already; None otherwise (then `read` it). A FUSE server answers such a read from its
        own thread: no hop to the event loop for a chunk the prefetch brought."""
        end = min(offset + length, self.size)
        if offset < 0 or end <= offset:
            return None
        size = self.manifest.chunk_size
        needed = range(offset // size, -(-end // size))
        if not all(self._present[i] for i in needed):
            return None
        self._touch(needed)
        try:
            return _pread(self.path, end - offset, offset)
        except OSError:  # renamed onto its place meanwhile: `read` goes by the new name
            return None

    def _touch(self, needed: range) -> None:
        """Record the chunks a read needs, first time each: fetched already by the prefetch
        or not, they are what the next restore wants first."""
        for index in needed:
            if index not in self._seen and self.entry.chunks[index] is not None:
                self._seen.add(index)
                self.touched.append(index)

    async def complete(self, order: Iterable[int] = (), prefetch: int = BACKGROUND) -> None:
        """Fetch every chunk not present yet: those of `order` first, `prefetch` at a time
        (at least `BACKGROUND`), then the rest in file order, `BACKGROUND` at a time, each
        worker waiting while a read waits. Raises `ChunkError` like `read`."""
        count = len(self._present)
        ahead = [i for i in dict.fromkeys(order) if 0 <= i < count]
        taken = set(ahead)
        rest = [i for i in range(count) if i not in taken]

        async def worker(pending: Iterator[int], yields: bool) -> None:
            for index in pending:
                if yields:
                    await self._no_reads.wait()
                await self._ensure(index)

        first = iter(ahead)
        await asyncio.gather(*(worker(first, False) for _ in range(max(prefetch, BACKGROUND))))
        then = iter(rest)
        await asyncio.gather(*(worker(then, True) for _ in range(BACKGROUND)))

    async def _ensure(self, index: int) -> None:
        if self._present[index]:
            return
        task = self._fetching.get(index)
        if task is None:
            task = asyncio.create_task(self._fetch(index))
            self._fetching[index] = task
            task.add_done_callback(lambda _: self._fetching.pop(index, None))
        # Shielded: one reader giving up must not cancel the fetch others wait on.
        await asyncio.shield(task)

    async def _fetch(self, index: int) -> None:
        deadline = time.monotonic() + self.patience
        peers = await self._peers()
        while True:
            try:
                data = await self.repository.fetch_chunk(self.manifest, self.entry, index, peers)
                break
            except UnreachableChunk as error:  # others (missing, corrupt): asking cannot help
                if time.monotonic() + RETRY_PAUSE > deadline:
                    raise UnreachableChunk(
                        error.digest,
                        error.manifest_id,
                        error.path,
                        error.offset,
                        f"could not be had from any source within {self.patience:g} s ({error})",
                    ) from error
                log.warning("chunk %d of %s: %s; asking again", index, self.entry.path, error)
                await asyncio.sleep(RETRY_PAUSE)
                peers = await self._peers(stale=peers)
        await asyncio.to_thread(_write, self.path, index * self.manifest.chunk_size, data)
        self._present[index] = True

    async def _peers(self, stale: PeerSession | None = None) -> PeerSession:
        """The file's peer session; a new one when `stale` is the current one (its peers
        failed to give a chunk)."""
        async with self._session_lock:
            if self._session is None or self._session is stale:
                self._session = await self.repository.peer_session(self.manifest.id)
            return self._session


# Each read and write opens the file for itself: no descriptor is shared with a thread that
# could outlive `close` and write through a number the process has since reused.
def _pread(path: Path, length: int, offset: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def _write(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        write_sparse(fd, offset, data)
    finally:
        os.close(fd)
