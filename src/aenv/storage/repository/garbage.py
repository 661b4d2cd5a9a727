"""Garbage collection: delete the chunks no manifest needs, never one a manifest or a put needs.

The protocol, between puts and collections on any number of nodes sharing a store:

1. A put writes every chunk it needs that the store lacks, and only then its manifest (an
   atomic write). So a manifest in the store never names a chunk that is not (yet) there, and a
   crash mid-put leaves only unreferenced chunks behind, never a manifest with holes in it.
2. A put holds a `put` lease from before its first existence check until its manifest is
   written, and waits while any live `gc` lease exists. A collection holds a `gc` lease and
   does nothing while any live `put` lease exists. Each writes its own lease before it looks
   for the other kind, so if both start together at least one sees the other (whichever looked
   second finds the first's lease already written): a put never checks that a chunk exists
   while a collection that could delete it runs, which is the race that would otherwise lose a
   chunk (a put finds chunk X present and skips it, a collection that listed manifests before
   the put's was written deletes X, the put then commits a manifest naming X).
3. A collection, under its lease: marks every chunk named by any manifest, lists the chunks,
   and deletes those that are unmarked *and* older than the grace period (default one hour).
   If it cannot read a manifest it deletes nothing. Between batches of deletions it gives way
   to any put that has started (it stops; the next run goes on), so a put waits for at most one
   batch, and it checks its own lease is still valid.
4. The grace period is a second line of defence: it keeps the chunks of a put that is still
   running or has just crashed (the put's retry reuses them instead of uploading them again),
   and covers a lease that expired under a process that was stalled longer than its lifetime.

Deleting a manifest is a single delete and needs no lease: its chunks become unmarked and go at
the next collection past the grace period. Leases of dead processes expire on their own and are
removed by the next collection.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

from aenv.storage.repository import leases
from aenv.storage.repository.chunks import CHUNKS, digest_of
from aenv.storage.repository.leases import Lease
from aenv.storage.repository.manifest import PREFIX as MANIFESTS
from aenv.storage.repository.manifest import id_of, read_if_present
from aenv.storage.repository.pool import Pool
from aenv.storage.repository.store import BlobInfo, BlobStore

DEFAULT_GRACE = 3600.0
BATCH = 256


@dataclass(frozen=True)
class GcReport:
    manifests: int = 0
    chunks_referenced: int = 0
    chunks_deleted: int = 0
    bytes_deleted: int = 0
    chunks_in_grace: int = 0  # unreferenced but younger than the grace period: kept
    busy: bool = False  # a put was running: nothing was deleted, or not everything


def _list(store: BlobStore, prefix: str) -> list[BlobInfo]:
    return list(store.list(prefix))


async def collect(store: BlobStore, pool: Pool, *, grace: float, lease_ttl: float) -> GcReport:
    async with Lease(store, "gc", lease_ttl) as lease:
        if await leases.live(store, "put"):
            return GcReport(busy=True)
        manifest_ids = [i for b in await pool.run(_list, store, MANIFESTS) if (i := id_of(b.key))]
        found = await pool.map(partial(read_if_present, store, i) for i in manifest_ids)
        manifests = [m for m in found if m is not None]
        referenced = set().union(*(m.digests() for m in manifests))

        cutoff = time.time() - grace
        garbage: list[BlobInfo] = []
        in_grace = 0
        for blob in await pool.run(_list, store, CHUNKS):
            if digest_of(blob.key) in referenced:
                continue
            if blob.modified > cutoff:
                in_grace += 1
            else:
                garbage.append(blob)

        deleted: list[BlobInfo] = []
        busy = False
        for start in range(0, len(garbage), BATCH):
            lease.check()
            if await leases.live(store, "put"):
                busy = True
                break
            batch = garbage[start : start + BATCH]
            await pool.map(partial(store.delete, blob.key) for blob in batch)
            deleted.extend(batch)

        for kind in ("put", "gc"):
            _, expired = await pool.run(leases.scan, store, kind)
            await pool.map(partial(store.delete, key) for key in expired)

    return GcReport(
        manifests=len(manifests),
        chunks_referenced=len(referenced),
        chunks_deleted=len(deleted),
        bytes_deleted=sum(blob.size for blob in deleted),
        chunks_in_grace=in_grace,
        busy=busy,
    )
