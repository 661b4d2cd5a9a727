"""Diff memory files merged over their base, on real sparse files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aenv.runtime.firecracker.memfile import MemoryFileError, data_extents, merge_diff

PAGE = 4096
SIZE = 64 * PAGE


def sparse(path: Path, pages: dict[int, bytes], size: int = SIZE) -> Path:
    with path.open("wb") as f:
        f.truncate(size)
        for n, byte in pages.items():
            f.seek(n * PAGE)
            f.write(byte * PAGE)
    return path


def extents(path: Path) -> list[tuple[int, int]]:
    with path.open("rb") as f:
        return list(data_extents(f.fileno(), os.fstat(f.fileno()).st_size))


def test_data_extents_skip_holes(tmp_path: Path) -> None:
    f = sparse(tmp_path / "m", {3: b"a", 4: b"b", 40: b"c"})
    found = extents(f)
    # Filesystems may round extents up, never miss data: every written page is covered.
    for n in (3, 4, 40):
        assert any(o <= n * PAGE and n * PAGE + PAGE <= o + ln for o, ln in found), n
    assert sum(ln for _, ln in found) < SIZE
    assert extents(sparse(tmp_path / "empty", {})) == []


async def test_merge_lays_the_diff_over_a_copy_of_the_base(tmp_path: Path) -> None:
    base = sparse(tmp_path / "base", {0: b"B", 1: b"B", 5: b"B"})
    diff = sparse(tmp_path / "diff", {1: b"D", 9: b"D"})
    out = tmp_path / "merged"
    await merge_diff(diff, base, out)
    data = out.read_bytes()
    page = {n: data[n * PAGE : (n + 1) * PAGE] for n in range(SIZE // PAGE)}
    assert page[0] == b"B" * PAGE
    assert page[1] == b"D" * PAGE  # the diff wins
    assert page[5] == b"B" * PAGE  # untouched base page kept
    assert page[9] == b"D" * PAGE
    assert page[2] == bytes(PAGE)
    assert out.stat().st_blocks * 512 < SIZE  # still sparse
    assert base.read_bytes()[PAGE : 2 * PAGE] == b"B" * PAGE  # base untouched
    assert not list(tmp_path.glob("*.partial"))


async def test_merge_refuses_a_diff_larger_than_its_base(tmp_path: Path) -> None:
    base = sparse(tmp_path / "base", {0: b"B"})
    diff = sparse(tmp_path / "diff", {0: b"D"}, size=2 * SIZE)
    with pytest.raises(MemoryFileError, match="larger than its base"):
        await merge_diff(diff, base, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob("*.partial"))


async def test_merge_across_filesystems(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    diff = sparse(shm / f"aenv-fc-test-diff-{os.getpid()}", {2: b"D"})
    try:
        base = sparse(tmp_path / "base", {0: b"B"})
        await merge_diff(diff, base, tmp_path / "out")
        data = (tmp_path / "out").read_bytes()
        assert data[:PAGE] == b"B" * PAGE and data[2 * PAGE : 3 * PAGE] == b"D" * PAGE
    finally:
        diff.unlink()
