"""Files of a restored manifest served in place (`storage/lazytree.py`): another process reads
them at their own paths before they are here, only what it reads is fetched first, the rest
comes in the background until they are ordinary local files (a reader that kept the file open
reads on); closing before that removes the incomplete copy; a chunk gone from the store fails
the reader and the owner, never reads as zeros; a serving process `kill -9`ed leaves mounts
that `sweep` detaches."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.storage import lazytree
from aenv.storage.fusefile import SOURCE
from aenv.storage.lazytree import LazyTree
from aenv.storage.repository import ChunkCache, Manifest, PosixStore, Repository
from aenv.storage.repository.chunks import chunk_key

pytestmark = pytest.mark.skipif(not lazytree.available(), reason="FUSE mounts need root")


@pytest.fixture(autouse=True)
def no_mounts_left(tmp_path: Path) -> Iterator[None]:
    """Whatever a test leaves mounted, also when it fails, is detached."""
    yield
    lazytree.sweep(tmp_path)


MiB = 1 << 20
DATA_CHUNKS = (0, 3, 6, 7)  # of 8 MiB; the rest are holes


async def stored(tmp_path: Path) -> tuple[PosixStore, Manifest, dict[str, bytes]]:
    memory = bytearray(8 * MiB)
    for index in DATA_CHUNKS:
        memory[index * MiB : (index + 1) * MiB] = os.urandom(MiB)
    files = {"memory": bytes(memory), "images/root.img": os.urandom(3 * MiB), "state": b"s"}
    for name, content in files.items():
        (tmp_path / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / name).write_bytes(content)
    store = PosixStore(tmp_path / "store")
    writer = Repository(store)
    try:
        return store, await writer.put_tree(tmp_path / "src", name="checkpoint"), files
    finally:
        writer.close()


def lazy_mounts(under: Path) -> list[str]:
    """The lazy mounts under `under` (other tests on the machine may have their own)."""
    with open("/proc/self/mountinfo") as mounts:
        return [line for line in mounts if f" - fuse {SOURCE} " in line and f" {under}/" in line]


# Reads ranges of a file as a VMM would (another process): prints each as hex; with "hold",
# keeps the file open and reads again at the offsets after a line on stdin.
READER = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
ranges = [tuple(map(int, r.split(":"))) for r in sys.argv[2:]]
for offset, length in ranges:
    print(os.pread(fd, length, offset).hex(), flush=True)
if os.environ.get("HOLD"):
    sys.stdin.readline()
    for offset, length in ranges:
        print(os.pread(fd, length, offset).hex(), flush=True)
"""


async def read(path: Path, *ranges: tuple[int, int]) -> tuple[int, list[bytes]]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", READER, str(path), *(f"{o}:{n}" for o, n in ranges),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    out, _ = await process.communicate()
    assert process.returncode is not None
    return process.returncode, [bytes.fromhex(line) for line in out.decode().split()]


async def test_served_in_place_then_local(tmp_path: Path) -> None:
    store, manifest, files = await stored(tmp_path)
    repo = Repository(store, ChunkCache(tmp_path / "cache", 1 << 30))
    dest = tmp_path / "dest"
    served = ["memory", "images/root.img"]
    try:
        await repo.get_tree(manifest.id, dest, defer=served)
        assert (dest / "state").read_bytes() == b"s"
        assert repo.stats.chunks_fetched == 1  # the state file only
        tree = await LazyTree.serve(repo, manifest, dest, served)
        tree._done.cancel()  # type: ignore[union-attr]  # no background fetch: reads only
        code, pages = await read(dest / "memory", (3 * MiB + 4096, 4096))
        assert code == 0
        assert pages == [files["memory"][3 * MiB + 4096 : 3 * MiB + 8192]]
        assert repo.stats.chunks_fetched == 2  # the one chunk the read needed
        assert tree.touched == {"memory": [3], "images/root.img": []}
        await tree.close()
        assert not dest.exists()  # an incomplete copy is no copy
        assert lazy_mounts(tmp_path) == []
    finally:
        repo.close()


async def test_completed_in_the_background_while_a_reader_holds_it(tmp_path: Path) -> None:
    store, manifest, files = await stored(tmp_path)
    repo = Repository(store, ChunkCache(tmp_path / "cache", 1 << 30))
    dest = tmp_path / "dest"
    served = ["memory", "images/root.img"]
    try:
        await repo.get_tree(manifest.id, dest, defer=served)
        tree = await LazyTree.serve(repo, manifest, dest, served, {"memory": [7]})
        reader = await asyncio.create_subprocess_exec(
            sys.executable, "-c", READER, str(dest / "memory"), f"{6 * MiB + 8192}:4096",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "HOLD": "1"},
        )  # fmt: skip
        assert reader.stdout is not None and reader.stdin is not None
        first = bytes.fromhex((await reader.stdout.readline()).decode())
        assert first == files["memory"][6 * MiB + 8192 : 6 * MiB + 12288]
        await tree.wait_whole()
        assert tree.whole
        assert lazy_mounts(tmp_path) == []  # detached: the reader's open file is served on
        for name, content in files.items():
            assert (dest / name).read_bytes() == content
            assert not os.path.ismount(dest / name)
        assert sorted(p.name for p in dest.iterdir()) == ["images", "memory", "state"]
        reader.stdin.write(b"\n")
        again, _ = await reader.communicate()
        assert bytes.fromhex(again.decode()) == first
        assert reader.returncode == 0
        await tree.close()
        assert (dest / "memory").read_bytes() == files["memory"]  # a whole copy stays
    finally:
        repo.close()


async def test_a_chunk_no_source_gives_fails_reader_and_owner(tmp_path: Path) -> None:
    store, manifest, files = await stored(tmp_path)
    memory = next(f for f in manifest.files if f.path == "memory")
    digest = memory.chunks[6]
    assert digest is not None
    store.delete(chunk_key(digest))
    repo = Repository(store, ChunkCache(tmp_path / "cache", 1 << 30))
    dest = tmp_path / "dest"
    failures: list[BaseException] = []
    try:
        await repo.get_tree(manifest.id, dest, defer=["memory"])
        tree = await LazyTree.serve(repo, manifest, dest, ["memory"])
        tree.on_failure = failures.append
        code, pages = await read(dest / "memory", (0, 4096), (6 * MiB, 4096))
        assert code != 0  # EIO for the page whose chunk is gone: never zeros
        assert pages == [files["memory"][:4096]]
        with pytest.raises(Exception, match=digest):
            await tree.wait_whole()
        assert len(failures) == 1 and tree.error is failures[0]
        await tree.close()
        assert not dest.exists()
        assert lazy_mounts(tmp_path) == []
    finally:
        repo.close()


SERVER = """
import asyncio, sys
from pathlib import Path
from aenv.storage.lazytree import LazyTree
from aenv.storage.repository import PosixStore, Repository

async def main():
    repo = Repository(PosixStore(Path(sys.argv[1])))
    dest = Path(sys.argv[3])
    manifest = await repo.manifest(sys.argv[2])
    await repo.get_tree(manifest.id, dest, defer=["memory"])
    tree = await LazyTree.serve(repo, manifest, dest, ["memory"])
    tree._done.cancel()
    print("serving", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_sweep_detaches_what_a_killed_server_left(tmp_path: Path) -> None:
    _, manifest, _ = await stored(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SERVER, str(tmp_path / "store"), manifest.id, str(home / "dest"),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        assert await server.stdout.readline() == b"serving\n"
        assert len(lazy_mounts(tmp_path)) == 2  # the FUSE mount and its bind onto the file
    finally:
        server.send_signal(signal.SIGKILL)
        await server.wait()
    try:
        assert len(lazy_mounts(tmp_path)) == 2  # dead, but there
        assert lazytree.sweep(tmp_path / "elsewhere") == []
        swept = lazytree.sweep(home)
        assert sorted(swept) == [home / "dest" / ".memory.mnt", home / "dest" / "memory"]
        assert lazy_mounts(tmp_path) == []
    finally:
        lazytree.sweep(home)
