"""The node-local chunk cache: its byte bound and LRU order, and restores through it (cold
fetches from the store, warm does not; a damaged entry is fetched again)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.storage.repository import ChunkCache, PosixStore, Repository

MiB = 1 << 20


def blob(n: int, size: int = 1000) -> bytes:
    return random.Random(n).randbytes(size)


def cached_files(cache: ChunkCache) -> set[str]:
    return {p.name for p in cache.directory.glob("??/*")}


def test_lru_eviction_stays_under_the_byte_bound(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path / "cache", max_bytes=3000)
    for name in "abc":
        cache.put(name * 64, blob(ord(name)))
    assert cache.get("a" * 64) == blob(ord("a"))  # a is now the most recently used
    cache.put("d" * 64, blob(ord("d")))

    stats = cache.stats
    assert (stats.entries, stats.used_bytes, stats.evictions) == (3, 3000, 1)
    assert cached_files(cache) == {"a" * 64, "c" * 64, "d" * 64}  # b went: least recently used
    assert cache.get("b" * 64) is None
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)

    cache.put("e" * 64, blob(0, 3001))  # larger than the whole cache: not cached
    assert cached_files(cache) == {"a" * 64, "c" * 64, "d" * 64}

    # A restarted node finds its cache, in its order, and applies a smaller bound.
    reopened = ChunkCache(tmp_path / "cache", max_bytes=2000)
    assert cached_files(reopened) == {"a" * 64, "d" * 64}
    assert reopened.stats.used_bytes == 2000


def snapshot(root: Path) -> Path:
    rnd = random.Random(5)
    root.mkdir()
    with (root / "memory").open("wb") as fh:
        fh.truncate(64 * MiB)
        fh.seek(8 * MiB)
        fh.write(rnd.randbytes(6 * MiB))
    (root / "snapshot.json").write_text("{}")
    return root


@pytest.fixture
def store(tmp_path: Path) -> PosixStore:
    return PosixStore(tmp_path / "store")


@pytest.fixture
def repos(store: PosixStore) -> Iterator[list[Repository]]:
    opened: list[Repository] = []
    yield opened
    for repo in opened:
        repo.close()


def open_repo(repos: list[Repository], store: PosixStore, cache: ChunkCache | None) -> Repository:
    repo = Repository(store, cache)
    repos.append(repo)
    return repo


async def test_cold_restore_fetches_and_warm_does_not(
    tmp_path: Path, store: PosixStore, repos: list[Repository]
) -> None:
    src = snapshot(tmp_path / "src")
    manifest = await open_repo(repos, store, None).put_tree(src, name="a")
    chunks = len(manifest.digests())

    # Another node: an empty cache.
    cache = ChunkCache(tmp_path / "cache", max_bytes=64 * MiB)
    repo = open_repo(repos, store, cache)
    await repo.get_tree(manifest.id, tmp_path / "cold")
    assert (cache.stats.hits, cache.stats.misses) == (0, chunks)
    assert repo.stats.chunks_fetched == chunks
    cold_bytes = repo.stats.bytes_fetched
    assert cold_bytes > 6 * MiB

    await repo.get_tree(manifest.id, tmp_path / "warm")
    assert (cache.stats.hits, cache.stats.misses) == (chunks, chunks)
    assert repo.stats.bytes_fetched == cold_bytes  # nothing more from the store
    assert (tmp_path / "warm" / "memory").read_bytes() == (src / "memory").read_bytes()


async def test_chunks_stored_from_this_node_are_cached(
    tmp_path: Path, store: PosixStore, repos: list[Repository]
) -> None:
    cache = ChunkCache(tmp_path / "cache", max_bytes=64 * MiB)
    repo = open_repo(repos, store, cache)
    manifest = await repo.put_tree(snapshot(tmp_path / "src"), name="a")
    await repo.get_tree(manifest.id, tmp_path / "dest")
    assert repo.stats.bytes_fetched == 0
    assert cache.stats.hits == len(manifest.digests())
    assert repo.stats.chunks_from_cache == len(manifest.digests())


async def test_a_put_caches_the_chunks_the_store_had_already(
    tmp_path: Path, store: PosixStore, repos: list[Repository]
) -> None:
    src = snapshot(tmp_path / "src")
    await open_repo(repos, store, None).put_tree(src, name="a")  # another node stored them
    cache = ChunkCache(tmp_path / "cache", max_bytes=64 * MiB)
    repo = open_repo(repos, store, cache)
    manifest = await repo.put_tree(src, name="b")
    assert repo.stats.chunks_uploaded == 0  # the store had every chunk...
    assert cache.stats.entries == len(manifest.digests())  # ...and this node holds them now
    await repo.get_tree(manifest.id, tmp_path / "dest")
    assert (repo.stats.chunks_from_cache, repo.stats.chunks_fetched) == (cache.stats.entries, 0)


async def test_a_small_cache_still_restores_and_stays_bounded(
    tmp_path: Path, store: PosixStore, repos: list[Repository]
) -> None:
    src = snapshot(tmp_path / "src")
    manifest = await open_repo(repos, store, None).put_tree(src, name="a")
    cache = ChunkCache(tmp_path / "cache", max_bytes=2 * MiB + MiB // 2)
    repo = open_repo(repos, store, cache)
    for n in range(2):
        await repo.get_tree(manifest.id, tmp_path / f"dest{n}")
        assert (tmp_path / f"dest{n}" / "memory").read_bytes() == (src / "memory").read_bytes()
        assert cache.stats.used_bytes <= cache.max_bytes
    on_disk = sum(p.stat().st_size for p in cache.directory.glob("??/*"))
    assert on_disk == cache.stats.used_bytes
    assert cache.stats.evictions > 0


async def test_a_damaged_cache_entry_is_fetched_again(
    tmp_path: Path, store: PosixStore, repos: list[Repository]
) -> None:
    src = snapshot(tmp_path / "src")
    cache = ChunkCache(tmp_path / "cache", max_bytes=64 * MiB)
    repo = open_repo(repos, store, cache)
    manifest = await repo.put_tree(src, name="a")
    victim = next(iter(cache.directory.glob("??/*")))
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))

    await repo.get_tree(manifest.id, tmp_path / "dest")
    assert (tmp_path / "dest" / "memory").read_bytes() == (src / "memory").read_bytes()
    assert repo.stats.chunks_fetched == 1  # only the damaged one, from the store
    assert victim.read_bytes() != bytes(data)  # and the cache holds a good copy again
