"""Memory on demand, the mechanism: a stored memory file read lazily (`LazyFile`) as a file on a
FUSE mount of its own (`storage/fusefile.py`), mapped privately by another process as a VMM
maps guest memory, and by a real QEMU as its guest RAM (`memory-backend-file`, `share=off`, as
restores map a snapshot's memory). Pages come on first touch, only their chunks are fetched,
and a page whose chunk cannot be had is a SIGBUS in the mapper, never zeros."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from aenv.storage.fusefile import FuseFile
from aenv.storage.repository import ChunkCache, Manifest, PosixStore, Repository
from aenv.storage.repository.chunks import chunk_key
from aenv.storage.repository.lazy import LazyFile

MiB = 1 << 20
DATA_CHUNKS = (0, 2, 5, 9, 15)  # of 16 MiB: the rest are holes, as untouched guest pages are
ROM = 0xF0000


async def stored(tmp_path: Path) -> tuple[PosixStore, Manifest, bytes]:
    content = bytearray(16 * MiB)
    for index in DATA_CHUNKS:
        content[index * MiB : (index + 1) * MiB] = os.urandom(MiB)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "memory").write_bytes(content)
    store = PosixStore(tmp_path / "store")
    writer = Repository(store)
    try:
        return store, await writer.put_tree(tmp_path / "src", name="memory"), bytes(content)
    finally:
        writer.close()


@asynccontextmanager
async def mounted(
    store: PosixStore, manifest: Manifest, tmp_path: Path
) -> AsyncIterator[tuple[FuseFile, LazyFile, Repository]]:
    """The memory file of another node (an empty cache), on a FUSE mount."""
    repo = Repository(store, ChunkCache(tmp_path / "cache", 1 << 30))
    lazy = LazyFile(repo, manifest, manifest.files[0], tmp_path / "lazy.mem")
    fuse = FuseFile(lazy, "memory")
    (tmp_path / "mnt").mkdir()
    fuse.mount(tmp_path / "mnt", asyncio.get_running_loop())
    try:
        yield fuse, lazy, repo
    finally:
        fuse.unmount()
        lazy.close()
        repo.close()


# A process mapping the file as a VMM does: read-write open, private mapping; it prints the
# pages it is asked for (hex), then writes into one of them and reads it back.
MAPPER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
for offset in map(int, sys.argv[2:]):
    print(m[offset : offset + 4096].hex(), flush=True)
m[int(sys.argv[2])] = m[int(sys.argv[2])] ^ 0xFF
print(m[int(sys.argv[2]) : int(sys.argv[2]) + 4096].hex())
"""


async def mapper(path: Path, *offsets: int) -> tuple[int, list[bytes]]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", MAPPER, str(path), *map(str, offsets),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await process.communicate()
    assert process.returncode is not None
    return process.returncode, [bytes.fromhex(line) for line in out.decode().split()]


async def test_a_mapping_fills_the_pages_it_touches(tmp_path: Path) -> None:
    store, manifest, content = await stored(tmp_path)
    async with mounted(store, manifest, tmp_path) as (fuse, lazy, repo):
        assert os.stat(fuse.path).st_size == 16 * MiB
        page = 5 * MiB + 12 * 4096
        code, pages = await mapper(fuse.path, page, 7 * MiB)
        assert code == 0
        assert pages[0] == content[page : page + 4096]
        assert pages[1] == bytes(4096)  # a hole: zeros are its content
        changed = bytes([content[page] ^ 0xFF]) + content[page + 1 : page + 4096]
        assert pages[2] == changed  # the mapper's own copy of the page...
        assert (lazy.touched, repo.stats.chunks_fetched) == ([5], 1)
        # ...which reached neither the file nor the next mapper.
        code, again = await mapper(fuse.path, page)
        assert code == 0 and again[0] == content[page : page + 4096]
        assert repo.stats.chunks_fetched == 1  # in the kernel's page cache now


async def test_qemu_maps_it_as_guest_ram(tmp_path: Path) -> None:
    store, manifest, content = await stored(tmp_path)
    async with mounted(store, manifest, tmp_path) as (fuse, lazy, repo):
        dump = tmp_path / "dump"
        qemu = await asyncio.create_subprocess_exec(
            "qemu-system-x86_64", "-M", "microvm,memory-backend=mem", "-m", "16M",
            "-object", f"memory-backend-file,id=mem,size=16M,mem-path={fuse.path},share=off",
            "-accel", "tcg", "-S", "-nodefaults", "-display", "none", "-monitor", "stdio",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        # The guest never runs (-S): the monitor reads its RAM, as a restored guest would.
        await qemu.communicate(f'pmemsave 0 {16 * MiB} "{dump}"\nquit\n'.encode())
        assert qemu.returncode == 0
        ram = dump.read_bytes()
        # The firmware's ROM shows through at 0xf0000-0xfffff, over RAM: the rest is RAM.
        assert ram[:ROM] == content[:ROM] and ram[MiB:] == content[MiB:]
        assert sorted(lazy.touched) == list(DATA_CHUNKS)  # holes are never fetched
        assert repo.stats.chunks_fetched == len(DATA_CHUNKS)


async def test_a_page_no_source_gives_is_a_sigbus_never_zeros(tmp_path: Path) -> None:
    store, manifest, content = await stored(tmp_path)
    lost = manifest.files[0].chunks[9]
    assert lost is not None
    (tmp_path / "store" / chunk_key(lost)).unlink()
    async with mounted(store, manifest, tmp_path) as (fuse, _, _):
        code, pages = await mapper(fuse.path, 2 * MiB, 9 * MiB)
    assert code == -signal.SIGBUS
    assert pages == [content[2 * MiB : 2 * MiB + 4096]]  # the page before it came


async def test_local_chunks_are_answered_without_the_event_loop(tmp_path: Path) -> None:
    """A read whose chunks the background brought is answered on the server's own thread: a
    reader gets it while the event loop is stopped (here: blocked on purpose until it has)."""
    store, manifest, content = await stored(tmp_path)
    async with mounted(store, manifest, tmp_path) as (fuse, lazy, _):
        await lazy.complete()
        got: list[bytes] = []

        def read() -> None:
            with open(fuse.path, "rb") as fh:
                fh.seek(9 * MiB)
                got.append(fh.read(4096))

        reader = threading.Thread(target=read)
        reader.start()
        reader.join(timeout=30)  # blocks the event loop: a read needing it could not answer
        assert not reader.is_alive() and got == [content[9 * MiB : 9 * MiB + 4096]]
        assert lazy.touched == [9]  # recorded all the same: the next restore wants it first
        reader.join()
