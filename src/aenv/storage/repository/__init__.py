"""The snapshot repository: directory trees as manifests of content-addressed chunks.

A snapshot (device state, guest memory, disk layers, `snapshot.json`) is stored as a manifest
naming fixed-size chunks by their SHA-256; each chunk is stored once, zstd-compressed, whatever
number of snapshots share it, and all-zero chunks are not stored at all. Storing a snapshot
writes only the chunks the store lacks; every read verifies its hash; a node-local cache bounded
in bytes keeps recently used chunks; garbage collection removes chunks no manifest needs, safely
alongside puts from any node (protocol: `garbage.py`). In a cluster, a restore reads the chunks
its cache lacks from the nodes that hold them before the store (`sources.py`).

Layout in the store (a POSIX directory or an S3 bucket, optionally below a prefix):

    chunks/<2 hex>/<sha256>        one zstd frame of up to 1 MiB (chunks.py)
    manifests/<sha256>.json        a manifest, named by the hash of its bytes (manifest.py)
    leases/<put|gc>-<token>.json   who is storing or collecting right now (leases.py)

    repo = Repository(PosixStore(path), ChunkCache(cache_dir, max_bytes=8 << 30))
    manifest = await repo.put_tree(snapshot_dir, name="sandbox-x", metadata={...})
    await repo.get_tree(manifest.id, restore_dir)
"""

from aenv.storage.repository.cache import CacheStats, ChunkCache
from aenv.storage.repository.chunks import CHUNK_SIZE
from aenv.storage.repository.errors import (
    BlobNotFound,
    ChunkError,
    CorruptChunk,
    CorruptManifest,
    LeaseLost,
    ManifestNotFound,
    MissingChunk,
    RepositoryError,
    StoreUnavailable,
    UnreachableChunk,
)
from aenv.storage.repository.garbage import GcReport
from aenv.storage.repository.manifest import FileEntry, Manifest
from aenv.storage.repository.posix import PosixStore
from aenv.storage.repository.repository import Repository, RepositoryStats
from aenv.storage.repository.s3 import S3Store
from aenv.storage.repository.sources import PeerDirectory, PeerLocation, Source
from aenv.storage.repository.store import BlobInfo, BlobStore

__all__ = [
    "CHUNK_SIZE",
    "BlobInfo",
    "BlobNotFound",
    "BlobStore",
    "CacheStats",
    "ChunkCache",
    "ChunkError",
    "CorruptChunk",
    "CorruptManifest",
    "FileEntry",
    "GcReport",
    "LeaseLost",
    "Manifest",
    "ManifestNotFound",
    "MissingChunk",
    "PeerDirectory",
    "PeerLocation",
    "PosixStore",
    "Repository",
    "RepositoryError",
    "RepositoryStats",
    "S3Store",
    "Source",
    "StoreUnavailable",
    "UnreachableChunk",
]
