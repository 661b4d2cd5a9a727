"""files.* through the async SDK."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import AsyncIterator

import pytest
from e2b import AsyncSandbox, FileType, NotFoundException
from e2b.sandbox.filesystem.filesystem import WriteEntry

MIB = 1024 * 1024


@pytest.fixture
async def adir(async_sandbox: AsyncSandbox) -> AsyncIterator[str]:
    path = f"/home/user/ta-{uuid.uuid4().hex[:8]}"
    assert await async_sandbox.files.make_dir(path)
    yield path
    await async_sandbox.files.remove(path)


async def test_write_read_text_and_bytes(async_sandbox: AsyncSandbox, adir: str) -> None:
    await async_sandbox.files.write(f"{adir}/t.txt", "text ✓")
    assert await async_sandbox.files.read(f"{adir}/t.txt") == "text ✓"
    data = os.urandom(4096)
    await async_sandbox.files.write(f"{adir}/b.bin", data)
    assert await async_sandbox.files.read(f"{adir}/b.bin", format="bytes") == data


async def test_large_file_streamed_both_ways(async_sandbox: AsyncSandbox, adir: str) -> None:
    size = 100 * MIB
    block = hashlib.sha256(b"async").digest() * (MIB // 32)
    expected = hashlib.sha256()
    for _ in range(size // MIB):
        expected.update(block)

    async def blocks() -> AsyncIterator[bytes]:
        for _ in range(size // MIB):
            yield block

    await async_sandbox.files.write(f"{adir}/big.bin", blocks(), request_timeout=300)
    stream = await async_sandbox.files.read(f"{adir}/big.bin", format="stream", request_timeout=300)
    received = hashlib.sha256()
    total = 0
    async for chunk in stream:
        received.update(chunk)
        total += len(chunk)
    assert total == size
    assert received.hexdigest() == expected.hexdigest()


async def test_write_files_and_list(async_sandbox: AsyncSandbox, adir: str) -> None:
    infos = await async_sandbox.files.write_files(
        [
            WriteEntry(path=f"{adir}/a.txt", data="a"),
            WriteEntry(path=f"{adir}/n/e/s/t.txt", data=b"t"),
        ]
    )
    assert {i.path for i in infos} == {f"{adir}/a.txt", f"{adir}/n/e/s/t.txt"}
    names = {e.name for e in await async_sandbox.files.list(adir)}
    assert names == {"a.txt", "n"}
    deep = {e.path for e in await async_sandbox.files.list(adir, depth=4)}
    assert f"{adir}/n/e/s/t.txt" in deep


async def test_info_exists_make_dir_rename_remove(async_sandbox: AsyncSandbox, adir: str) -> None:
    files = async_sandbox.files
    await files.write(f"{adir}/f.txt", "abc")
    info = await files.get_info(f"{adir}/f.txt")
    assert (info.type, info.size, info.owner, info.permissions) == (
        FileType.FILE,
        3,
        "user",
        "-rw-r--r--",
    )
    assert await files.exists(f"{adir}/f.txt")
    assert not await files.exists(f"{adir}/g.txt")
    assert await files.make_dir(f"{adir}/d")
    assert not await files.make_dir(f"{adir}/d")
    moved = await files.rename(f"{adir}/f.txt", f"{adir}/d/f.txt")
    assert moved.path == f"{adir}/d/f.txt"
    await files.remove(f"{adir}/d")
    assert not await files.exists(f"{adir}/d")
    with pytest.raises(NotFoundException):
        await files.get_info(f"{adir}/d")
    with pytest.raises(NotFoundException):
        await files.read(f"{adir}/d/f.txt")


async def test_gzip_and_metadata(async_sandbox: AsyncSandbox, adir: str) -> None:
    data = b"zip me " * 5000
    info = await async_sandbox.files.write(f"{adir}/z", data, gzip=True, metadata={"a": "b"})
    assert info.metadata == {"a": "b"}
    assert await async_sandbox.files.read(f"{adir}/z", format="bytes", gzip=True) == data
    assert (await async_sandbox.files.get_info(f"{adir}/z")).metadata == {"a": "b"}
