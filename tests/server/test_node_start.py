"""A node's start next to other nodes on one host, without guests: a guest build cache shared
read-only (a read-only bind mount)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from aenv.config import Paths
from aenv.orchestrator.images import prepare_images
from tests.support.guest import GUEST_CACHE, MIRROR


@contextmanager
def read_only_view(source: Path, at: Path) -> Iterator[Path]:
    """`source` bind-mounted read-only at `at`, as a cache another host's node fills."""
    at.mkdir()
    subprocess.run(["mount", "--bind", str(source), str(at)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(at)], check=True)
        yield at
    finally:
        subprocess.run(["umount", str(at)], check=True)


async def test_a_guest_cache_shared_read_only_serves_a_node(tmp_path: Path) -> None:
    filled = await prepare_images(Paths(tmp_path / "filler").cache, GUEST_CACHE, MIRROR)
    with read_only_view(GUEST_CACHE, tmp_path / "shared") as shared:
        images = await prepare_images(Paths(tmp_path / "home").cache, shared, MIRROR)
    assert images.identity == filled.identity
    for image in (images.kernel, images.initrd, images.rootfs, images.envd_drive):
        assert image.is_relative_to(tmp_path / "home") and image.is_file()
