"""Disk layers on real files: writable uppers, raw copies."""

from __future__ import annotations

import subprocess
from pathlib import Path

from aenv.guest.cmdline import UPPER_LABEL
from aenv.storage import layers


async def test_new_upper_is_sparse_ext4(tmp_path: Path) -> None:
    upper = await layers.new_upper(tmp_path / "upper.img", 1024)
    assert upper.stat().st_size == 1024 << 20
    assert layers.allocated_bytes(upper) < 64 << 20
    label = subprocess.run(["e2label", str(upper)], capture_output=True, text=True, check=True)
    assert label.stdout.strip() == UPPER_LABEL


async def test_raw_copy_for_vmms_without_cow(tmp_path: Path) -> None:
    upper = await layers.new_upper(tmp_path / "upper.img", 256)
    copy = await layers.sparse_copy(upper, tmp_path / "copy.img")
    assert copy.read_bytes() == upper.read_bytes()
    assert layers.allocated_bytes(copy) <= layers.allocated_bytes(upper) + (1 << 20)
