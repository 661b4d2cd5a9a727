"""The snapshot repository on both backends: a POSIX directory and a real S3 server (moto) on
loopback. Round trips, incremental puts, damage detection, garbage collection and its protocol."""

from __future__ import annotations

import asyncio
import os
import random
import secrets
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from aenv.storage.repository import (
    CHUNK_SIZE,
    BlobStore,
    CorruptChunk,
    CorruptManifest,
    Manifest,
    ManifestNotFound,
    MissingChunk,
    PosixStore,
    Repository,
    RepositoryError,
    S3Store,
)
from aenv.storage.repository.chunks import chunk_key, encode, hash_chunk
from aenv.storage.repository.leases import Lease
from aenv.storage.repository.manifest import manifest_key
from tests.support.ports import free_port

MiB = 1 << 20


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def s3_store(endpoint: str) -> S3Store:
    bucket = f"repo-{secrets.token_hex(4)}"
    credentials = {"aws_access_key_id": "test", "aws_secret_access_key": "test"}
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **credentials).create_bucket(
        Bucket=bucket
    )
    return S3Store(
        bucket,
        endpoint_url=endpoint,
        region="us-east-1",
        access_key_id="test",
        secret_access_key="test",
        prefix="aenv",
    )


@pytest.fixture(params=["posix", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    if request.param == "posix":
        return PosixStore(tmp_path / "store")
    return s3_store(request.getfixturevalue("s3_endpoint"))


@pytest.fixture
def repo(store: BlobStore) -> Iterator[Repository]:
    repository = Repository(store)
    yield repository
    repository.close()


def write_file(path: Path, size: int, extents: dict[int, bytes], mode: int = 0o644) -> None:
    """A sparse file of `size` bytes holding `extents` (offset -> bytes), holes elsewhere."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        fh.truncate(size)
        for offset, data in extents.items():
            fh.seek(offset)
            fh.write(data)
    path.chmod(mode)


def snapshot_dir(root: Path, seed: int = 1, memory_mib: int = 64) -> Path:
    """What a paused sandbox looks like: sparse memory, device state, a disk layer, metadata."""
    rnd = random.Random(seed)
    write_file(
        root / "memory",
        memory_mib * MiB,
        {
            3 * MiB + 4096: rnd.randbytes(2 * MiB + 777),  # unaligned, across chunks
            20 * MiB: bytes(3 * MiB),  # written zeros: allocated, yet all-zero chunks
            40 * MiB + 12288: rnd.randbytes(8192),  # two pages in an otherwise empty chunk
        },
        mode=0o600,
    )
    write_file(root / "state", 300_000, {0: rnd.randbytes(300_000)})
    write_file(root / "layers" / "upper.qcow2", 32 * MiB, {MiB: rnd.randbytes(MiB)})
    write_file(root / "empty", 0, {})
    (root / "snapshot.json").write_text('{"vcpus": 1, "memory_mib": 64}')
    return root


def assert_same_tree(a: Path, b: Path) -> None:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b
    for rel in files_a:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
        assert (a / rel).stat().st_mode == (b / rel).stat().st_mode, rel


def tree_of(root: Path, chunks: list[bytes]) -> Path:
    """A one-file tree whose chunks are exactly `chunks`."""
    write_file(
        root / "memory", len(chunks) * CHUNK_SIZE, {i * CHUNK_SIZE: d for i, d in enumerate(chunks)}
    )
    return root


def allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def chunk_digests(store: BlobStore) -> set[str]:
    return {info.key.rpartition("/")[2] for info in store.list("chunks/")}


def some_chunk(manifest: Manifest, path: str = "memory") -> str:
    entry = next(f for f in manifest.files if f.path == path)
    return next(d for d in entry.chunks if d is not None)


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".partial-" in p.name]


async def test_roundtrip_is_bit_exact_and_sparse(repo: Repository, tmp_path: Path) -> None:
    src = snapshot_dir(tmp_path / "src")
    manifest = await repo.put_tree(src, name="sandbox-a/pause", metadata={"template": "base"})

    # Only chunks with data are stored: 3 + 1 in memory, 1 state, 1 disk, 1 snapshot.json.
    assert repo.stats.chunks_uploaded == len(chunk_digests(repo.store)) == 7
    assert manifest.digests() == chunk_digests(repo.store)
    memory = next(f for f in manifest.files if f.path == "memory")
    assert memory.size == 64 * MiB
    assert sum(d is not None for d in memory.chunks) == 4
    assert memory.chunks[20] is None  # the written zeros

    dest = tmp_path / "restored"
    restored = await repo.get_tree(manifest.id, dest)
    assert restored == manifest
    assert_same_tree(src, dest)
    # Holes stay holes, down to zero pages inside stored chunks.
    assert allocated(dest / "memory") <= 2 * MiB + 777 + 8192 + 3 * 4096
    assert allocated(dest / "layers" / "upper.qcow2") <= MiB

    assert [m.id for m in await repo.list_manifests()] == [manifest.id]
    assert (await repo.manifest(manifest.id)).metadata == {"template": "base"}
    with pytest.raises(FileExistsError):
        await repo.get_tree(manifest.id, dest)


async def test_incremental_put_writes_only_the_change(repo: Repository, tmp_path: Path) -> None:
    rnd = random.Random(7)
    src = tmp_path / "src"
    write_file(src / "memory", 256 * MiB, {16 * MiB: rnd.randbytes(48 * MiB)})
    first = await repo.put_tree(src, name="full")
    full = repo.stats

    # The guest dirties 1 MiB, not chunk-aligned: it spans two chunks.
    with (src / "memory").open("r+b") as fh:
        fh.seek(30 * MiB + 100_000)
        fh.write(rnd.randbytes(MiB))
    second = await repo.put_tree(src, name="incremental")
    stats = repo.stats

    assert stats.chunks_uploaded - full.chunks_uploaded == 2
    assert stats.chunks_deduplicated - full.chunks_deduplicated == 46
    incremental = stats.bytes_uploaded - full.bytes_uploaded
    assert incremental <= 0.05 * full.bytes_uploaded
    assert incremental <= 0.05 * 256 * MiB

    await repo.get_tree(second.id, tmp_path / "second")
    assert (tmp_path / "second" / "memory").read_bytes() == (src / "memory").read_bytes()
    await repo.get_tree(first.id, tmp_path / "first")
    with (tmp_path / "first" / "memory").open("rb") as fh:
        fh.seek(30 * MiB + 100_000)
        assert fh.read(MiB) != (src / "memory").read_bytes()[30 * MiB + 100_000 :][:MiB]


@pytest.mark.parametrize("where", ["frame header", "data"])
async def test_flipped_byte_in_a_stored_chunk_is_detected(
    repo: Repository, tmp_path: Path, where: str
) -> None:
    manifest = await repo.put_tree(snapshot_dir(tmp_path / "src"), name="a")
    digest = some_chunk(manifest)
    blob = bytearray(repo.store.get(chunk_key(digest)))
    blob[7 if where == "frame header" else len(blob) // 2] ^= 0x01
    repo.store.put(chunk_key(digest), bytes(blob))

    with pytest.raises(CorruptChunk) as caught:
        await repo.get_tree(manifest.id, tmp_path / "dest")
    assert caught.value.digest == digest
    assert caught.value.manifest_id == manifest.id
    assert caught.value.path == "memory"
    assert digest in str(caught.value) and manifest.id in str(caught.value)
    assert not (tmp_path / "dest").exists()
    assert leftovers(tmp_path) == []


async def test_chunk_with_other_content_is_detected(repo: Repository, tmp_path: Path) -> None:
    """A well-formed zstd frame of the wrong bytes (a mixed-up object) is caught by the hash."""
    manifest = await repo.put_tree(snapshot_dir(tmp_path / "src"), name="a")
    digest = some_chunk(manifest, "state")
    repo.store.put(chunk_key(digest), encode(random.Random(99).randbytes(300_000)))
    with pytest.raises(CorruptChunk, match="does not match its hash"):
        await repo.get_tree(manifest.id, tmp_path / "dest")


async def test_missing_chunk_is_detected(repo: Repository, tmp_path: Path) -> None:
    manifest = await repo.put_tree(snapshot_dir(tmp_path / "src"), name="a")
    digest = some_chunk(manifest, "layers/upper.qcow2")
    repo.store.delete(chunk_key(digest))
    with pytest.raises(MissingChunk) as caught:
        await repo.get_tree(manifest.id, tmp_path / "dest")
    assert caught.value.digest == digest
    assert caught.value.path == "layers/upper.qcow2"
    assert caught.value.offset == MiB
    assert leftovers(tmp_path) == []


async def test_manifest_damage_and_unknown_ids(repo: Repository, tmp_path: Path) -> None:
    manifest = await repo.put_tree(snapshot_dir(tmp_path / "src"), name="a")
    key = manifest_key(manifest.id)
    data = repo.store.get(key)
    repo.store.put(key, data.replace(b'"mode":384', b'"mode":511'))
    with pytest.raises(CorruptManifest):
        await repo.get_tree(manifest.id, tmp_path / "dest")
    with pytest.raises(ManifestNotFound):
        await repo.manifest("0" * 64)
    with pytest.raises(ManifestNotFound):
        await repo.manifest("../../etc/passwd")


async def test_refuses_what_it_cannot_restore(repo: Repository, tmp_path: Path) -> None:
    src = snapshot_dir(tmp_path / "src")
    (src / "link").symlink_to(src / "state")
    with pytest.raises(RepositoryError, match="regular files"):
        await repo.put_tree(src, name="a")
    with pytest.raises(TypeError):
        await repo.put_tree(src, name="a", metadata={"when": object()})
    with pytest.raises(FileNotFoundError):
        await repo.put_tree(tmp_path / "missing", name="a")
    assert list(repo.store.list("")) == []


async def test_gc_collects_only_unreferenced_chunks(repo: Repository, tmp_path: Path) -> None:
    rnd = random.Random(3)
    shared = rnd.randbytes(2 * MiB)
    write_file(tmp_path / "a" / "disk", 8 * MiB, {0: shared, 4 * MiB: rnd.randbytes(MiB)})
    write_file(tmp_path / "b" / "disk", 8 * MiB, {0: shared, 6 * MiB: rnd.randbytes(MiB)})
    a = await repo.put_tree(tmp_path / "a", name="a")
    b = await repo.put_tree(tmp_path / "b", name="b")
    assert repo.stats.chunks_deduplicated == 2

    report = await repo.gc(grace=0)
    assert (report.manifests, report.chunks_deleted, report.chunks_referenced) == (2, 0, 4)

    await repo.delete_manifest(a.id)
    await repo.delete_manifest(a.id)  # idempotent
    report = await repo.gc(grace=0)
    assert report.chunks_deleted == 1 and not report.busy
    assert report.bytes_deleted > 0
    assert chunk_digests(repo.store) == b.digests()
    await repo.get_tree(b.id, tmp_path / "b-restored")
    assert_same_tree(tmp_path / "b", tmp_path / "b-restored")


async def test_gc_deletes_nothing_if_a_manifest_is_unreadable(
    repo: Repository, tmp_path: Path
) -> None:
    a = await repo.put_tree(snapshot_dir(tmp_path / "a", seed=1), name="a")
    b = await repo.put_tree(snapshot_dir(tmp_path / "b", seed=2), name="b")
    repo.store.put(manifest_key(b.id), b"{}")
    await repo.delete_manifest(a.id)
    with pytest.raises(CorruptManifest):
        await repo.gc(grace=0)
    assert chunk_digests(repo.store) == a.digests() | b.digests()
    assert list(repo.store.list("leases/")) == []


async def test_gc_after_a_crashed_put(repo: Repository, tmp_path: Path) -> None:
    """A put that died after writing chunks, before its manifest: the chunks are kept for the
    grace period (a retry reuses them), then collected; its stale lease does not block gc."""
    kept = await repo.put_tree(snapshot_dir(tmp_path / "src"), name="kept")
    orphans = [random.Random(i).randbytes(MiB) for i in range(3)]
    for data in orphans:
        repo.store.put(chunk_key(hash_chunk(data)), encode(data))
    dead = b'{"kind": "put", "expires": 1.0, "host": "gone", "pid": 1}'
    repo.store.put("leases/put-deadbeef.json", dead)

    report = await repo.gc()  # default grace: an hour
    assert not report.busy
    assert (report.chunks_deleted, report.chunks_in_grace) == (0, 3)
    assert list(repo.store.list("leases/")) == []  # the dead lease is cleared

    retry = await repo.put_tree(tree_of(tmp_path / "retry", orphans), name="retry")
    assert repo.stats.chunks_deduplicated == 3  # reused, not uploaded again
    assert retry.digests() == {hash_chunk(d) for d in orphans}
    await repo.delete_manifest(retry.id)
    report = await repo.gc(grace=0)
    assert report.chunks_deleted == 3
    assert chunk_digests(repo.store) == kept.digests()


async def test_gc_gives_way_to_a_running_put(repo: Repository, tmp_path: Path) -> None:
    manifest = await repo.put_tree(snapshot_dir(tmp_path / "src"), name="a")
    await repo.delete_manifest(manifest.id)
    async with Lease(repo.store, "put"):
        report = await repo.gc(grace=0)
    assert report.busy and report.chunks_deleted == 0
    assert chunk_digests(repo.store) == manifest.digests()
    assert (await repo.gc(grace=0)).chunks_deleted == len(manifest.digests())


async def test_put_waits_for_a_running_gc(repo: Repository, tmp_path: Path) -> None:
    src = snapshot_dir(tmp_path / "src")
    async with Lease(repo.store, "gc"):
        put = asyncio.create_task(repo.put_tree(src, name="a"))
        while len(list(repo.store.list("leases/put-"))) == 0:
            await asyncio.sleep(0.01)
        # The put announced itself and now waits: it writes nothing while gc holds its lease.
        await asyncio.sleep(0.3)
        assert not put.done()
        assert list(repo.store.list("chunks/")) == []
    manifest = await put
    assert chunk_digests(repo.store) == manifest.digests()


async def test_concurrent_puts_and_gc_lose_no_chunk(repo: Repository, tmp_path: Path) -> None:
    """Each round deletes the previous manifest and stores a tree reusing most of its chunks
    while a collection with no grace period runs: every live manifest must still restore."""
    rnd = random.Random(11)
    chunks = [rnd.randbytes(MiB) for _ in range(6)]
    live = await repo.put_tree(tree_of(tmp_path / "t0", chunks), name="t0")
    for round_ in range(1, 6):
        chunks[round_] = rnd.randbytes(MiB)
        await repo.delete_manifest(live.id)
        src = tree_of(tmp_path / f"t{round_}", chunks)
        live, _ = await asyncio.gather(repo.put_tree(src, name=f"t{round_}"), repo.gc(grace=0))
        await repo.get_tree(live.id, tmp_path / f"r{round_}")
        assert_same_tree(src, tmp_path / f"r{round_}")
    await repo.gc(grace=0)
    assert chunk_digests(repo.store) == live.digests()


def test_posix_store_rejects_keys_outside_its_root(tmp_path: Path) -> None:
    store = PosixStore(tmp_path / "store")
    for key in ("../x", "a/../../x", "/etc/passwd", ".tmp/x", "a//b", ""):
        with pytest.raises(ValueError):
            store.put(key, b"x")
    store.put("a/b", b"x")
    assert [info.key for info in store.list("a/")] == ["a/b"]
    assert os.listdir(tmp_path / "store" / ".tmp") == []
