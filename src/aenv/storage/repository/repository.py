"""`Repository`: stores directory trees as manifests of chunks, restores them, collects garbage.

`put_tree` cuts every file into chunks (`chunks.py`), writes the chunks the store lacks, then
the manifest (`manifest.py`); `get_tree` materialises a manifest into a new directory, sparse,
verifying every chunk, and renames it into place only when complete, so a failed or interrupted
restore leaves nothing that looks like a snapshot. Chunk reads go through the node's
`ChunkCache` when there is one, then, for a restore, through the peers a `PeerDirectory` names
(`sources.py`), then the store; every chunk a node stores or restores stays in its cache, which
is what its peers read. Puts and `gc` follow the protocol in `garbage.py`. All blocking work runs
in a bounded thread pool (`pool.py`); the methods are coroutines for the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import stat
import threading
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from aenv.storage.repository import leases
from aenv.storage.repository.cache import ChunkCache
from aenv.storage.repository.chunks import (
    CHUNK_SIZE,
    DecodeError,
    chunk_indices,
    chunk_key,
    decode,
    encode,
    hash_chunk,
    is_zero,
    write_sparse,
)
from aenv.storage.repository.errors import (
    BlobNotFound,
    CorruptChunk,
    ManifestNotFound,
    MissingChunk,
    RepositoryError,
    StoreUnavailable,
    UnreachableChunk,
)
from aenv.storage.repository.garbage import DEFAULT_GRACE, GcReport, collect
from aenv.storage.repository.leases import Lease
from aenv.storage.repository.manifest import PREFIX as MANIFESTS
from aenv.storage.repository.manifest import (
    FileEntry,
    Manifest,
    build,
    id_of,
    is_manifest_id,
    manifest_key,
    read,
    read_if_present,
)
from aenv.storage.repository.pool import DEFAULT_WORKERS, Pool
from aenv.storage.repository.posix import fsync_dir
from aenv.storage.repository.sources import PeerDirectory, PeerSession, Source, http_client
from aenv.storage.repository.store import BlobStore

# How often a put looks again whether a collection it waits for has finished.
GC_POLL_SECONDS = 0.25
# Manifests kept in memory once read (a few KiB to a few hundred KiB each).
KNOWN_MANIFESTS = 64


@dataclass
class RepositoryStats:
    """Counters since the repository was opened (cache hits and misses: `ChunkCache.stats`)."""

    chunks_uploaded: int = 0
    bytes_uploaded: int = 0  # compressed, as written to the store
    chunks_deduplicated: int = 0  # already in the store: not written again
    chunks_fetched: int = 0  # read from the store by restores
    bytes_fetched: int = 0  # compressed, as read from the store
    chunks_from_peers: int = 0  # read from other nodes' caches by restores
    bytes_from_peers: int = 0  # compressed, as the peers sent them
    chunks_from_cache: int = 0  # read from this node's cache by restores
    bytes_from_cache: int = 0  # compressed, as cached
    peer_failures: int = 0  # peers a restore left out after an error, a timeout or a bad chunk

    def count(self, source: Source, stored_bytes: int) -> None:
        """One chunk a restore read from `source`, `stored_bytes` long as stored."""
        if source is Source.STORE:
            self.chunks_fetched += 1
            self.bytes_fetched += stored_bytes
        elif source is Source.PEER:
            self.chunks_from_peers += 1
            self.bytes_from_peers += stored_bytes
        else:
            self.chunks_from_cache += 1
            self.bytes_from_cache += stored_bytes


@dataclass(frozen=True)
class _Source:
    relpath: str
    path: Path
    size: int
    mode: int


class Repository:
    def __init__(
        self,
        store: BlobStore,
        cache: ChunkCache | None = None,
        *,
        workers: int = DEFAULT_WORKERS,
        gc_grace: float = DEFAULT_GRACE,
        lease_ttl: float = leases.DEFAULT_TTL,
    ) -> None:
        self.store = store
        self.cache = cache
        self.gc_grace = gc_grace
        self.lease_ttl = lease_ttl
        self._pool = Pool(workers)
        self._stats = RepositoryStats()  # changed on the event loop, or under `_lock`
        self._lock = threading.Lock()
        # Set by a cluster node (`use_peers`): restores ask the peers before the store.
        self._peers: PeerDirectory | None = None
        self._http: httpx.Client | None = None
        self._manifests: OrderedDict[str, Manifest] = OrderedDict()  # read before, newest last

    @property
    def stats(self) -> RepositoryStats:
        return replace(self._stats)

    def close(self) -> None:
        self._pool.close()
        if self._http is not None:
            self._http.close()

    def use_peers(self, directory: PeerDirectory | None) -> None:
        """Restore through the peers `directory` names (None: from the store only)."""
        self._peers = directory
        if directory is not None and self._http is None:
            self._http = http_client()

    async def cached_chunk(self, digest: str) -> bytes | None:
        """A chunk as this node's cache holds it (compressed, unverified: its reader checks
        it), or None; what a peer's restore asks this node for."""
        if self.cache is None:
            return None
        return await self._pool.run(self.cache.get, digest)

    async def put_tree(
        self, directory: Path, *, name: str, metadata: Mapping[str, Any] | None = None
    ) -> Manifest:
        """Store the regular files below `directory` as a new manifest and return it."""
        # Through JSON and back: fails now rather than after the upload, and the caller's
        # dict can change afterwards without changing the manifest.
        meta: dict[str, Any] = json.loads(json.dumps(dict(metadata or {})))
        sources = await self._pool.run(_walk, directory)
        async with Lease(self.store, "put", self.lease_ttl) as lease:
            # Polling: the collection may run on another node, nothing here can signal its end.
            while await leases.live(self.store, "gc"):  # noqa: ASYNC110
                await asyncio.sleep(GC_POLL_SECONDS)
            indices = await self._pool.map(partial(_data_chunks, s) for s in sources)
            jobs = [(s, i) for s, found in zip(sources, indices, strict=True) for i in found]
            stored = await self._pool.map(partial(self._put_chunk, s, i) for s, i in jobs)
            chunks: dict[str, list[str | None]] = {
                s.relpath: [None] * -(-s.size // CHUNK_SIZE) for s in sources
            }
            for (source, index), (digest, written) in zip(jobs, stored, strict=True):
                chunks[source.relpath][index] = digest
                if written:
                    self._stats.chunks_uploaded += 1
                    self._stats.bytes_uploaded += written
                elif digest is not None:
                    self._stats.chunks_deduplicated += 1
            files = [
                FileEntry(s.relpath, s.size, s.mode, tuple(chunks[s.relpath])) for s in sources
            ]
            manifest, data = build(name, datetime.now(UTC), CHUNK_SIZE, files, meta)
            lease.check()
            await self._pool.run(self.store.put, manifest_key(manifest.id), data)
        if self._peers is not None:
            await self._peers.holding(manifest.id)
        return manifest

    def _put_chunk(self, source: _Source, index: int) -> tuple[str | None, int]:
        """(digest or None for zeros, compressed bytes written: 0 if the store had it)."""
        offset = index * CHUNK_SIZE
        length = min(CHUNK_SIZE, source.size - offset)
        fd = os.open(source.path, os.O_RDONLY)
        try:
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        if len(data) != length:
            raise RepositoryError(f"{source.path} shrank while it was being stored")
        if is_zero(data):
            return None, 0
        digest = hash_chunk(data)
        key = chunk_key(digest)
        if self.store.exists(key):
            # Cached all the same (compressed once per node): peers may then read the whole
            # manifest from this node, which `holding` tells them.
            if self.cache is not None and digest not in self.cache:
                self.cache.put(digest, encode(data))
            return digest, 0
        blob = encode(data)
        self.store.put(key, blob)
        if self.cache is not None:
            self.cache.put(digest, blob)
        return digest, len(blob)

    async def get_tree(
        self, manifest_id: str, dest: Path, *, defer: Collection[str] = ()
    ) -> Manifest:
        """Materialise a manifest as the new directory `dest` (sparse files); return it. The
        files of `defer` (paths in the manifest) are left empty, for their reader to fill
        (`lazytree`)."""
        manifest = await self.manifest(manifest_id)
        if dest.exists():
            raise FileExistsError(f"{dest} exists")
        staging = dest.parent / f".{dest.name}.partial-{secrets.token_hex(4)}"
        peers = await self.peer_session(manifest_id)
        try:
            await self._pool.run(_create_files, staging, manifest, frozenset(defer))
            jobs = [
                partial(self._restore_chunk, manifest, entry, index, staging / entry.path, peers)
                for entry in manifest.files
                if entry.path not in defer
                for index, digest in enumerate(entry.chunks)
                if digest is not None
            ]
            for source, stored_bytes in await self._pool.map(jobs):
                self._stats.count(source, stored_bytes)
            await self._pool.map(
                partial(_finish_file, staging / entry.path, entry.mode) for entry in manifest.files
            )
            await self._pool.run(_publish, staging, dest)
        except BaseException:
            # Synchronously: a cancelled restore must not leave its staging directory behind.
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if self._peers is not None:
            await self._peers.holding(manifest_id)
        return manifest

    def _restore_chunk(
        self, manifest: Manifest, entry: FileEntry, index: int, path: Path, peers: PeerSession
    ) -> tuple[Source, int]:
        """Write one chunk into `path`; returns where it came from and its size as stored."""
        data, source, stored_bytes = self._read_chunk(manifest, entry, index, peers)
        fd = os.open(path, os.O_WRONLY)
        try:
            write_sparse(fd, index * manifest.chunk_size, data)
        finally:
            os.close(fd)
        return source, stored_bytes

    async def read_file(self, manifest: Manifest, path: str) -> bytes:
        """The content of the small file `path` of `manifest`, every chunk verified; raises
        `KeyError` when it has none, `ChunkError` when a chunk cannot be had."""
        entry = next((f for f in manifest.files if f.path == path), None)
        if entry is None:
            raise KeyError(path)
        peers = await self.peer_session(manifest.id)
        parts = [
            await self.fetch_chunk(manifest, entry, index, peers)
            if digest is not None
            else bytes(min(manifest.chunk_size, entry.size - index * manifest.chunk_size))
            for index, digest in enumerate(entry.chunks)
        ]
        return b"".join(parts)

    async def peer_session(self, manifest_id: str) -> PeerSession:
        """The peers to ask for the manifest's chunks (none without a directory)."""
        found = await self._peers.peers(manifest_id) if self._peers is not None else ()
        return PeerSession(self._http, found, self._peer_failed)

    def _peer_failed(self) -> None:
        with self._lock:
            self._stats.peer_failures += 1

    async def fetch_chunk(
        self, manifest: Manifest, entry: FileEntry, index: int, peers: PeerSession
    ) -> bytes:
        """One chunk of `entry`, verified, read as a restore reads it (`_read_chunk`) and
        counted by source; raises `ChunkError`."""
        data, source, stored_bytes = await self._pool.run(
            self._read_chunk, manifest, entry, index, peers
        )
        self._stats.count(source, stored_bytes)
        return data

    def _read_chunk(
        self, manifest: Manifest, entry: FileEntry, index: int, peers: PeerSession
    ) -> tuple[bytes, Source, int]:
        """One chunk's bytes, verified: from the cache, a peer or the store, in that order."""
        digest = entry.chunks[index]
        assert digest is not None
        offset = index * manifest.chunk_size
        length = min(manifest.chunk_size, entry.size - offset)
        where = (digest, manifest.id, entry.path, offset)
        if self.cache is not None and (blob := self.cache.get(digest)) is not None:
            try:
                return decode(blob, digest, length), Source.CACHE, len(blob)
            except DecodeError:
                self.cache.discard(digest)
        found = peers.fetch(digest, length)
        if found is not None:
            if self.cache is not None:
                self.cache.put(digest, found.blob)
            return found.data, Source.PEER, len(found.blob)
        try:
            blob = self.store.get(chunk_key(digest))
        except BlobNotFound:
            raise MissingChunk(*where, "is missing from the store") from None
        except StoreUnavailable as e:
            problem = f"could not be read: no peer gave it and the store failed ({e})"
            raise UnreachableChunk(*where, problem) from e
        try:
            data = decode(blob, digest, length)
        except DecodeError as e:
            # A bad chunk must not stay: puts skip chunks the store has, so every later
            # snapshot holding the same data would share the damage. Gone, the next put
            # that has the data stores a good copy; manifests needing it meanwhile report
            # it missing.
            with contextlib.suppress(RepositoryError, OSError):
                self.store.delete(chunk_key(digest))
            raise CorruptChunk(
                *where, f"is corrupt in the store ({e}); removed from the store"
            ) from None
        if self.cache is not None:
            self.cache.put(digest, blob)
        return data, Source.STORE, len(blob)

    async def manifest(self, manifest_id: str) -> Manifest:
        """A stored manifest, verified; raises `ManifestNotFound` or `CorruptManifest`.

        One read before is answered again without the store: a manifest never changes (its id
        is its hash), so a restore goes on from the peers while the store is down. One deleted
        by another node since is then restored all the same if its chunks are still there."""
        known = self._manifests.get(manifest_id)
        if known is not None:
            self._manifests.move_to_end(manifest_id)
            return known
        manifest = await self._pool.run(read, self.store, manifest_id)
        self._manifests[manifest_id] = manifest
        if len(self._manifests) > KNOWN_MANIFESTS:
            self._manifests.popitem(last=False)
        return manifest

    async def list_manifests(self) -> list[Manifest]:
        """Every stored manifest, oldest first."""
        blobs = await self._pool.run(lambda: list(self.store.list(MANIFESTS)))
        ids = [i for blob in blobs if (i := id_of(blob.key)) is not None]
        found = await self._pool.map(partial(read_if_present, self.store, i) for i in ids)
        return sorted((m for m in found if m is not None), key=lambda m: m.created)

    async def delete_manifest(self, manifest_id: str) -> None:
        """Forget a manifest (idempotent); `gc` later removes the chunks only it needed."""
        if not is_manifest_id(manifest_id):
            raise ManifestNotFound(manifest_id)
        await self._pool.run(self.store.delete, manifest_key(manifest_id))
        self._manifests.pop(manifest_id, None)
        if self._peers is not None:
            await self._peers.dropped(manifest_id)

    async def gc(self, *, grace: float | None = None) -> GcReport:
        """Delete unreferenced chunks older than `grace` seconds (default: `gc_grace`)."""
        return await collect(
            self.store,
            self._pool,
            grace=self.gc_grace if grace is None else grace,
            lease_ttl=self.lease_ttl,
        )


def _raise(error: OSError) -> None:
    raise error


def _walk(directory: Path) -> list[_Source]:
    sources: list[_Source] = []
    # os.walk skips what it cannot read unless told otherwise: a partial snapshot is no snapshot.
    for root, dirs, files in os.walk(directory, onerror=_raise):
        dirs.sort()
        for name in [*dirs, *sorted(files)]:
            path = Path(root, name)
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                continue
            if not stat.S_ISREG(st.st_mode):
                raise RepositoryError(f"{path}: only regular files and directories can be stored")
            relpath = path.relative_to(directory).as_posix()
            sources.append(_Source(relpath, path, st.st_size, stat.S_IMODE(st.st_mode)))
    return sources


def _data_chunks(source: _Source) -> list[int]:
    fd = os.open(source.path, os.O_RDONLY)
    try:
        return chunk_indices(fd, source.size)
    finally:
        os.close(fd)


def _create_files(staging: Path, manifest: Manifest, deferred: frozenset[str]) -> None:
    staging.mkdir()
    for entry in manifest.files:
        path = staging / entry.path
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("xb") as fh:
            if entry.path not in deferred:  # a deferred one stays empty: it is not here yet
                fh.truncate(entry.size)  # all holes until chunks are written


def _finish_file(path: Path, mode: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _publish(staging: Path, dest: Path) -> None:
    """Make the restored tree durable, then visible under its name in one rename."""
    for root, _, _ in os.walk(staging):
        fsync_dir(Path(root))
    os.rename(staging, dest)
    fsync_dir(dest.parent)
