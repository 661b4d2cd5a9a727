"""The guest build cache: built once per input, never left half-built."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.guest.cache import cached_dir


async def test_builds_once_per_inputs(tmp_path: Path) -> None:
    calls: list[Path] = []

    async def build(directory: Path) -> None:
        calls.append(directory)
        (directory / "out").write_text("x")

    first = await cached_dir("thing", {"v": 1}, build, tmp_path)
    again = await cached_dir("thing", {"v": 1}, build, tmp_path)
    other = await cached_dir("thing", {"v": 2}, build, tmp_path)
    assert first == again != other
    assert len(calls) == 2
    assert (first / "out").read_text() == "x"


async def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    async def build(directory: Path) -> None:
        (directory / "partial").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await cached_dir("thing", {"v": 1}, build, tmp_path)
    assert [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
