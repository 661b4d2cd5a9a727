"""A guest image build cut short with mounts left in its tree (debootstrap's /proc and /sys):
the tree is unmounted before it is deleted, so the deletion never reaches what was mounted
there, whether the build failed in this process or died in an earlier one. Needs root (it
mounts); tests/guest/test_cache.py has the rest of the cache's tests."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv import mounts
from aenv.guest.cache import cache_key, cached_dir

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")


@pytest.fixture
def host_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory standing for the host's files, with one file in it; any mount the test
    leaves under tmp_path is undone after it."""
    outside = tmp_path / "host"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    yield outside
    mounts.unmount_under(tmp_path.resolve())


def _bind(source: Path, target: Path) -> None:
    target.mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(source), str(target)], check=True)


async def test_a_failed_build_is_unmounted_before_it_is_deleted(
    tmp_path: Path, host_dir: Path
) -> None:
    cache = tmp_path / "cache"

    async def build(tmp: Path) -> None:
        _bind(host_dir, tmp / "tree" / "proc")
        raise RuntimeError("debootstrap was killed")

    with pytest.raises(RuntimeError, match="killed"):
        await cached_dir("rootfs", {"n": 1}, build, cache)
    assert (host_dir / "precious").read_text() == "keep me"
    assert mounts.mounts_under(cache.resolve()) == []
    assert [p.name for p in cache.iterdir()] == [f".rootfs-{cache_key({'n': 1})}.lock"]


async def test_a_dead_builds_tree_is_unmounted_and_swept(tmp_path: Path, host_dir: Path) -> None:
    cache = tmp_path / "cache"
    entry = f"rootfs-{cache_key({'n': 2})}"
    # A build by a process that died (pid 1 never builds here): its tree still mounted.
    _bind(host_dir, cache / f".{entry}.tmp-1" / "tree" / "proc")

    async def build(tmp: Path) -> None:
        (tmp / "image").write_text("built")

    final = await cached_dir("rootfs", {"n": 2}, build, cache)
    assert (final / "image").read_text() == "built"
    assert (host_dir / "precious").read_text() == "keep me"
    assert mounts.mounts_under(cache.resolve()) == []
    assert not (cache / f".{entry}.tmp-1").exists()
