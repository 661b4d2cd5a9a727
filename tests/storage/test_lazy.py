"""Disks on demand, below the VM: a stored disk image read lazily (`LazyFile`) and served as the
file of a FUSE mount (`storage/fusefile.py`, as restores serve read-only drives) to QEMU's own
tools (`qemu-img`, `qemu-io`), from a repository on a real S3 server (moto) on loopback. QEMU
reads it bit for bit, fetching only the chunks it reads; a store that fails makes a read wait
and go on when it is back, or fail with an I/O error, never zeros. The chunks of a given order
come first, so many at a time, and the background fetch makes way for reads."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from moto.server import ThreadedMotoServer

from aenv.storage import lazytree
from aenv.storage.fusefile import FuseFile
from aenv.storage.repository import ChunkCache, Manifest, Repository, S3Store, UnreachableChunk
from aenv.storage.repository.lazy import LazyFile
from aenv.storage.repository.sources import PeerSession
from tests.storage.test_repository import s3_store
from tests.support.ports import free_port

pytestmark = pytest.mark.skipif(not lazytree.available(), reason="FUSE mounts need root")

MiB = 1 << 20
DATA_CHUNKS = (0, 3, 4, 9, 15)  # of 16: the rest are holes


def moto(port: int) -> ThreadedMotoServer:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server


@pytest.fixture
def s3() -> Iterator[tuple[ThreadedMotoServer, int]]:
    port = free_port()
    server = moto(port)
    try:
        yield server, port
    finally:
        server.stop()


@pytest.fixture
def store(s3: tuple[ThreadedMotoServer, int]) -> S3Store:
    return s3_store(f"http://127.0.0.1:{s3[1]}")


def image(path: Path) -> bytes:
    """A 16 MiB disk image with random data in `DATA_CHUNKS`, holes elsewhere."""
    data = bytearray(16 * MiB)
    for index in DATA_CHUNKS:
        data[index * MiB : (index + 1) * MiB - 100] = os.urandom(MiB - 100)
    path.parent.mkdir(parents=True)
    path.write_bytes(bytes(data))
    return bytes(data)


@pytest.fixture
async def stored(store: S3Store, tmp_path: Path) -> tuple[Manifest, bytes]:
    content = image(tmp_path / "src" / "root.img")
    writer = Repository(store)
    try:
        return await writer.put_tree(tmp_path / "src", name="image"), content
    finally:
        writer.close()


@pytest.fixture
def node(store: S3Store, tmp_path: Path) -> Iterator[Repository]:
    """Another node: an empty cache."""
    repo = Repository(store, ChunkCache(tmp_path / "cache", 1 << 30), workers=4)
    yield repo
    repo.close()


class Reported:
    """`lazy` as a FUSE file's source, the failures of its reads kept in `errors` (as a
    `LazyTree` tells its owner)."""

    def __init__(self, lazy: LazyFile, errors: list[Exception]) -> None:
        self.lazy = lazy
        self.errors = errors

    @property
    def size(self) -> int:
        return self.lazy.size

    async def read(self, offset: int, length: int) -> bytes:
        try:
            return await self.lazy.read(offset, length)
        except Exception as error:
            self.errors.append(error)
            raise


@asynccontextmanager
async def served(lazy: LazyFile, mountpoint: Path, errors: list[Exception]) -> AsyncIterator[str]:
    """`lazy` as the file `root.img` of a FUSE mount at `mountpoint`: its path."""
    mountpoint.mkdir()
    fuse = FuseFile(Reported(lazy, errors), "root.img")
    await asyncio.to_thread(fuse.mount, mountpoint, asyncio.get_running_loop())
    try:
        yield str(fuse.path)
    finally:
        await asyncio.to_thread(fuse.unmount)
        lazy.close()


async def qemu(*argv: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode()


async def test_qemu_reads_a_lazy_image_bit_for_bit(
    stored: tuple[Manifest, bytes], node: Repository, tmp_path: Path
) -> None:
    manifest, content = stored
    lazy = LazyFile(node, manifest, manifest.files[0], tmp_path / "lazy.img")
    errors: list[Exception] = []
    async with served(lazy, tmp_path / "mnt", errors) as url:
        code, out = await qemu("qemu-img", "convert", "-f", "raw", "-O", "raw", url,
                               str(tmp_path / "copy.img"))  # fmt: skip
        assert code == 0, out
        assert lazy.whole
    assert (tmp_path / "copy.img").read_bytes() == content
    assert (tmp_path / "lazy.img").read_bytes() == content
    assert node.stats.chunks_fetched == len(DATA_CHUNKS)  # holes are never fetched
    assert errors == []


async def test_a_read_fetches_its_chunk_only_and_complete_the_rest(
    stored: tuple[Manifest, bytes], node: Repository, tmp_path: Path
) -> None:
    manifest, content = stored
    lazy = LazyFile(node, manifest, manifest.files[0], tmp_path / "lazy.img")
    async with served(lazy, tmp_path / "mnt", []) as url:
        code, out = await qemu("qemu-io", "-r", "-f", "raw", "-c", "read 3M 8k", url)
        assert code == 0 and "read 8192/8192 bytes" in out, out
        assert (lazy.touched, node.stats.chunks_fetched) == ([3], 1)
        assert not lazy.whole
        # Two readers of one chunk at once: one fetch.
        both = await asyncio.gather(lazy.read(9 * MiB, 4096), lazy.read(9 * MiB + 10, 100))
        assert both == [content[9 * MiB : 9 * MiB + 4096], content[9 * MiB + 10 : 9 * MiB + 110]]
        assert node.stats.chunks_fetched == 2
        await lazy.complete(order=[15, 4])
        assert lazy.whole and node.stats.chunks_fetched == len(DATA_CHUNKS)
        assert lazy.touched == [3, 9]  # reads only: the background's fetches are no touches
        assert await lazy.read(16 * MiB - 10, 100) == content[-10:]  # short at the end
    assert (tmp_path / "lazy.img").read_bytes() == content


class Gated:
    """The node's `fetch_chunk`, each fetch held until its chunk is let through: which fetches
    are under way at once, and in what order they began."""

    def __init__(self, node: Repository, monkeypatch: pytest.MonkeyPatch) -> None:
        self.began: list[int] = []
        self.running: set[int] = set()
        self.most = 0
        self.gates: dict[int, asyncio.Event] = {}
        real = node.fetch_chunk

        async def fetch_chunk(
            manifest: Manifest, entry: object, index: int, peers: object
        ) -> bytes:
            self.began.append(index)
            self.running.add(index)
            self.most = max(self.most, len(self.running))
            try:
                await self.gate(index).wait()
                return await real(manifest, entry, index, peers)  # type: ignore[arg-type]
            finally:
                self.running.discard(index)

        monkeypatch.setattr(node, "fetch_chunk", fetch_chunk)

    def gate(self, index: int) -> asyncio.Event:
        return self.gates.setdefault(index, asyncio.Event())

    def open_all(self) -> None:
        for index in range(16):
            self.gate(index).set()


async def settle() -> None:
    """Until whatever can start has started (the fetches let through run in threads)."""
    for _ in range(20):
        await asyncio.sleep(0.01)


async def until(began: list[int], count: int) -> None:
    async with asyncio.timeout(30):
        while len(began) < count:
            await asyncio.sleep(0.01)
    await settle()


async def test_the_order_comes_first_prefetch_at_a_time(
    stored: tuple[Manifest, bytes],
    node: Repository,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    manifest, content = stored
    lazy = LazyFile(node, manifest, manifest.files[0], tmp_path / "lazy.img")
    gated = Gated(node, monkeypatch)
    completing = asyncio.create_task(lazy.complete(order=[15, 9, 4, 3], prefetch=3))
    await settle()
    assert gated.began == [15, 9, 4]  # three of the order at once, none of the rest
    gated.gate(15).set()
    await until(gated.began, 4)
    assert gated.began == [15, 9, 4, 3]
    gated.open_all()
    await completing
    assert gated.began[4:] == [0] and gated.most == 3
    assert lazy.whole and (tmp_path / "lazy.img").read_bytes() == content
    lazy.close()


async def test_the_background_makes_way_for_a_read(
    stored: tuple[Manifest, bytes],
    node: Repository,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    manifest, content = stored
    lazy = LazyFile(node, manifest, manifest.files[0], tmp_path / "lazy.img")
    gated = Gated(node, monkeypatch)
    reading = asyncio.create_task(lazy.read(9 * MiB, 4096))
    await settle()
    completing = asyncio.create_task(lazy.complete())
    await settle()
    # A read waits for chunk 9: the background starts nothing meanwhile.
    assert gated.began == [9]
    gated.gate(9).set()
    assert await reading == content[9 * MiB : 9 * MiB + 4096]
    await until(gated.began, 3)
    assert gated.began == [9, 0, 3]  # then it goes on, two at a time, in file order
    gated.open_all()
    await completing
    assert gated.began == [9, 0, 3, 4, 15] and gated.most == 2
    assert lazy.whole and lazy.touched == [9] and lazy.waited == 1
    await lazy.read(3 * MiB, 16)  # here already: needed, not waited for
    assert lazy.touched == [9, 3] and lazy.waited == 1
    lazy.close()


async def test_a_read_waits_for_a_store_that_comes_back(
    s3: tuple[ThreadedMotoServer, int],
    stored: tuple[Manifest, bytes],
    node: Repository,
    tmp_path: Path,
) -> None:
    manifest, content = stored
    await node.manifest(manifest.id)
    server, port = s3
    server.stop()
    lazy = LazyFile(node, manifest, manifest.files[0], tmp_path / "lazy.img", patience=120)
    errors: list[Exception] = []
    async with served(lazy, tmp_path / "mnt", errors) as url:
        reading = asyncio.create_task(
            qemu("qemu-io", "-r", "-f", "raw", "-c", "read -v 4M 16", url)
        )
        await asyncio.sleep(1)  # not a measure: the read is under way, its chunk unreachable
        assert not reading.done()
        back = moto(port)  # moto's data lives in this process: the same bucket is back
        try:
            code, out = await reading
        finally:
            back.stop()
    assert code == 0, out
    expected = " ".join(f"{b:02x}" for b in content[4 * MiB : 4 * MiB + 16])
    assert expected in out
    assert errors == []


async def test_a_source_that_stays_down_is_an_io_error_never_zeros(
    s3: tuple[ThreadedMotoServer, int],
    stored: tuple[Manifest, bytes],
    node: Repository,
    tmp_path: Path,
) -> None:
    manifest, _ = stored
    await node.manifest(manifest.id)
    s3[0].stop()
    lazy = LazyFile(node, manifest, manifest.files[0], tmp_path / "lazy.img", patience=1)
    errors: list[Exception] = []
    async with served(lazy, tmp_path / "mnt", errors) as url:
        _, out = await qemu("qemu-io", "-r", "-f", "raw", "-c", "read -v 4M 16", url)
        assert "Input/output error" in out, out
        assert errors and all(isinstance(e, UnreachableChunk) for e in errors)
        assert "could not be had from any source within 1 s" in str(errors[0])
        assert not lazy.whole
    # Nothing was written in place of the chunk: the local file is all holes still.
    with (tmp_path / "lazy.img").open("rb") as fh, pytest.raises(OSError) as hole:
        os.lseek(fh.fileno(), 0, os.SEEK_DATA)
    assert hole.value.errno == errno.ENXIO


async def test_the_peers_are_looked_up_once_for_the_reads(
    stored: tuple[Manifest, bytes],
    node: Repository,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    manifest, content = stored
    lookups: list[str] = []
    real = node.peer_session

    async def peer_session(manifest_id: str) -> PeerSession:
        lookups.append(manifest_id)
        return await real(manifest_id)

    monkeypatch.setattr(node, "peer_session", peer_session)
    lazy = LazyFile(node, manifest, manifest.files[0], tmp_path / "lazy.img")
    reads = await asyncio.gather(*(lazy.read(i * MiB, 16) for i in DATA_CHUNKS))
    assert reads == [content[i * MiB : i * MiB + 16] for i in DATA_CHUNKS]
    assert lookups == [manifest.id]  # one session for every chunk, not a lookup each
    lazy.close()
