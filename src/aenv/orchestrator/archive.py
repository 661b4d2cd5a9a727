"""Durable copies of saved sandbox states in the snapshot repository (`storage.repository`).

Pauses and snapshots are written to the node's disk first: that is fast, and it is what resumes
and creates read. A copy then goes to the repository in the background, cut into
content-addressed chunks of which only those the repository lacks are written, so a pause after
a small change costs little. When the local copy is missing or damaged (a lost disk, a wiped
cache), the copy is pulled back, every chunk verified, into the very directory it was exported
from, so the absolute paths in its `snapshot.json` hold again.

A pause checkpoint's disks may be layers stacked on earlier ones; the copy is exported
self-contained first (`Driver.export`) into a staging directory that is removed once uploaded,
and that a pull later recreates.

Every copy records the data directory (`AENV_HOME`) of the node that made it, so another node
sharing the repository can pull it (a cluster, `docs/cluster.md`): the absolute paths in its
`snapshot.json` are then moved from the maker's directories to the puller's, the export
directory to where it was pulled and the maker's home to the puller's. A `portable` archive
(a cluster node's) also puts the read-only files a checkpoint names (kernel, initramfs, root
and envd drives) into the copy: a restored guest's memory holds the page cache of exactly those
bytes, and another node's own images of the same name may differ (an ext4 image built twice
differs in its UUID and timestamps). Their chunks are stored once, whatever the number of
copies naming them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aenv.runtime.driver import SNAPSHOT_MANIFEST, Driver, Snapshot
from aenv.storage.lazytree import LazyTree
from aenv.storage.repository import PeerDirectory, RepositoryError, RepositoryStats, Source
from aenv.storage.repository import Repository as ChunkRepository

log = logging.getLogger("aenv.archive")


IMAGES = "images"
# The metadata of a copy that names the chunks its last lazy restore's guest needed, by file,
# in the order it needed them (JSON): a lazy pull of it fetches those first.
PREFETCH = "prefetch"


class Archive:
    def __init__(self, repository: ChunkRepository, home: Path, portable: bool = False) -> None:
        self.repository = repository
        self.home = home
        self.portable = portable

    async def push_checkpoint(
        self,
        snapshot: Snapshot,
        staging: Path,
        driver: Driver,
        *,
        name: str,
        metadata: Mapping[str, str],
    ) -> str:
        """Store a (layered) checkpoint of `driver`'s; returns its manifest id. `staging` must
        not exist."""
        await asyncio.to_thread(staging.mkdir, parents=True)
        try:
            await driver.export(snapshot, staging, move=False)
            if self.portable:
                await asyncio.to_thread(_take_images, staging)
            return await self.push_directory(staging, name=name, metadata=metadata)
        finally:
            await asyncio.to_thread(shutil.rmtree, staging, True)

    async def push_directory(
        self,
        directory: Path,
        *,
        name: str,
        metadata: Mapping[str, str],
        recorded: Path | None = None,
    ) -> str:
        """Store an already self-contained snapshot directory; returns its manifest id. A
        copy staged elsewhere is `recorded` as the directory its paths name."""
        manifest = await self.repository.put_tree(
            directory,
            name=name,
            metadata={
                **metadata,
                "directory": str(recorded or directory),
                "home": str(self.home),
            },
        )
        return manifest.id

    async def push_snapshot(
        self, directory: Path, staging: Path, *, name: str, metadata: Mapping[str, str]
    ) -> str:
        """Store a self-contained snapshot (a template or snapshot's build) in place; returns
        its manifest id. A `portable` copy also takes the read-only files it names, staged in
        `staging` (its files linked, its manifest rewritten), so the local one stays as is."""
        if not self.portable:
            return await self.push_directory(directory, name=name, metadata=metadata)
        await asyncio.to_thread(shutil.rmtree, staging, True)
        try:
            await asyncio.to_thread(_stage_portable, directory, staging)
            return await self.push_directory(
                staging, name=name, metadata=metadata, recorded=directory
            )
        finally:
            await asyncio.to_thread(shutil.rmtree, staging, True)

    async def pull(self, manifest_id: str, dest: Path, driver: Driver) -> Snapshot:
        """Materialise a stored snapshot at `dest` (where it was exported from), replacing any
        damaged local copy, and read it with `driver`. Raises `RepositoryError` (e.g. a corrupt
        or missing chunk) rather than ever returning a snapshot that differs from what was
        stored."""
        await asyncio.to_thread(shutil.rmtree, dest, True)
        # A sandbox another node made has no directory here yet.
        await asyncio.to_thread(dest.parent.mkdir, parents=True, exist_ok=True)
        manifest = await self.repository.get_tree(manifest_id, dest)
        moves = {
            str(manifest.metadata.get("directory", dest)): str(dest),
            str(manifest.metadata.get("home", self.home)): str(self.home),
        }
        await asyncio.to_thread(_relocate, dest / SNAPSHOT_MANIFEST, moves)
        return await driver.load_saved(dest)

    async def pull_lazily(
        self, manifest_id: str, dest: Path, driver: Driver, prefetch: int = 0
    ) -> tuple[Snapshot, LazyTree]:
        """As `pull`, but the files a guest reads sparsely (its memory file, its read-only
        drives) are served at their paths as they are read and fetched in the background
        (`storage.lazytree`; the caller closes the tree once no VM uses them). Their content
        is not read to check it: each chunk is checked against its digest as it comes. The
        chunks of the order recorded with the copy (`PREFETCH`) come first, `prefetch` at a
        time; with `prefetch` and no order recorded for the memory file, its chunks in file
        order: the restore's load of the saved state faults in most of them in that order
        (a layered state's changed pages are written into it, each page read first), so
        fetching ahead of it keeps the load from waiting on each in turn."""
        await asyncio.to_thread(shutil.rmtree, dest, True)
        await asyncio.to_thread(dest.parent.mkdir, parents=True, exist_ok=True)
        manifest = await self.repository.manifest(manifest_id)
        recorded = json.loads(await self.repository.read_file(manifest, SNAPSHOT_MANIFEST))
        maker = str(manifest.metadata.get("directory", dest))
        held = {f.path for f in manifest.files}
        served = [p for p in _sparsely_read(recorded, maker) if p in held]
        await self.repository.get_tree(manifest_id, dest, defer=served)
        moves = {maker: str(dest), str(manifest.metadata.get("home", self.home)): str(self.home)}
        await asyncio.to_thread(_relocate, dest / SNAPSHOT_MANIFEST, moves)
        order = json.loads(str(manifest.metadata.get(PREFETCH, "{}")))
        memory = _memory_file(recorded, maker)
        if prefetch and memory in served and memory not in order:
            entry = next(f for f in manifest.files if f.path == memory)
            order[memory] = list(range(len(entry.chunks)))
        tree = await LazyTree.serve(self.repository, manifest, dest, served, order, prefetch)
        try:
            snapshot = await driver.load_saved(dest, unread=[dest / p for p in served])
        except BaseException:
            await tree.close()
            raise
        return snapshot, tree

    async def drop(self, manifest_id: str) -> None:
        """Forget a stored snapshot (its chunks go at the next garbage collection)."""
        try:
            await self.repository.delete_manifest(manifest_id)
        except RepositoryError:
            log.exception("could not delete manifest %s", manifest_id)

    async def collect(self) -> None:
        try:
            report = await self.repository.gc()
        except RepositoryError:
            log.exception("repository garbage collection failed")
            return
        log.info("repository gc: %s", report)

    def close(self) -> None:
        self.repository.close()

    def use_peers(self, directory: PeerDirectory | None) -> None:
        """Pull through the other nodes' caches first (a cluster node's, `aenv.cluster.peers`)."""
        self.repository.use_peers(directory)

    async def cached_chunk(self, digest: str) -> bytes | None:
        """A chunk as this node's cache holds it, for a peer's pull (`api.chunks`)."""
        return await self.repository.cached_chunk(digest)

    @property
    def stats(self) -> RepositoryStats:
        """What this node stored and read since it started."""
        return self.repository.stats

    def reads(self) -> dict[str, tuple[int, int]]:
        """Chunks and bytes (compressed) pulls read since the node started, by source:
        `cache` (this node's), `peer` (other nodes' caches), `store`."""
        stats = self.repository.stats
        return {
            Source.CACHE.value: (stats.chunks_from_cache, stats.bytes_from_cache),
            Source.PEER.value: (stats.chunks_from_peers, stats.bytes_from_peers),
            Source.STORE.value: (stats.chunks_fetched, stats.bytes_fetched),
        }


def _sparsely_read(recorded: Mapping[str, Any], directory: str) -> list[str]:
    """The paths, relative to `directory`, of the memory file and read-only drives a
    snapshot's manifest (`recorded`, as written) names under it."""
    disks = recorded.get("spec", {}).get("disks", ())
    paths = [recorded.get("memory_file"), *(d.get("path") for d in disks if d.get("read_only"))]
    found = []
    for path in paths:
        if isinstance(path, str) and path.startswith(directory + "/"):
            found.append(path[len(directory) + 1 :])
    return found


def _memory_file(recorded: Mapping[str, Any], directory: str) -> str | None:
    """The path, relative to `directory`, of the memory file a snapshot's manifest names,
    when it lies under it."""
    path = recorded.get("memory_file")
    if isinstance(path, str) and path.startswith(directory + "/"):
        return path[len(directory) + 1 :]
    return None


def _relocate(manifest: Path, moves: Mapping[str, str]) -> None:
    """Rewrite the paths in a pulled `snapshot.json` that lie under a key of `moves` (tried in
    order: the export directory lies inside the home) to lie under its value. Blocking."""
    moves = {old: new for old, new in moves.items() if old != new}
    if not moves:
        return

    def move(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: move(v) for k, v in value.items()}
        if isinstance(value, list):
            return [move(v) for v in value]
        if isinstance(value, str):
            for old, new in moves.items():
                if value == old or value.startswith(old + "/"):
                    return new + value[len(old) :]
        return value

    manifest.write_text(json.dumps(move(json.loads(manifest.read_text())), indent=2))


def _stage_portable(directory: Path, staging: Path) -> None:
    """`directory`'s files linked into `staging`, and the read-only files its snapshot names
    taken in; the staged manifest names them as if under `directory`. Blocking."""
    shutil.copytree(directory, staging, copy_function=_link_or_copy)
    manifest = staging / SNAPSHOT_MANIFEST
    # Rewritten below: its own inode, not the local snapshot's.
    manifest.unlink()
    shutil.copyfile(directory / SNAPSHOT_MANIFEST, manifest)
    _take_images(staging)
    _relocate(manifest, {str(staging): str(directory)})


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem
        shutil.copyfile(source, target)


def _take_images(staging: Path) -> None:
    """Put the read-only files the exported snapshot in `staging` names into `staging/images`
    (linked, or copied across filesystems) and name those instead. Blocking."""
    snapshot = Snapshot.load_manifest(staging)
    images = staging / IMAGES
    images.mkdir()

    def take(path: Path) -> Path:
        target = images / path.name
        if not target.exists():
            try:
                os.link(path, target)
            except OSError:  # another filesystem
                shutil.copyfile(path, target)
        return target

    spec = snapshot.spec
    disks = tuple(
        dataclasses.replace(d, path=take(d.path)) if d.read_only else d for d in spec.disks
    )
    initrd = take(spec.initrd) if spec.initrd is not None else None
    spec = dataclasses.replace(spec, kernel=take(spec.kernel), initrd=initrd, disks=disks)
    dataclasses.replace(snapshot, spec=spec).save_manifest(staging)
