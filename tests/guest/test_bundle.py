"""The envd bundle drive, from a single executable or from a directory."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from aenv.guest.bundle import build_envd_drive
from aenv.guest.cmdline import ENVD_LABEL


def ls(image: Path) -> str:
    return subprocess.run(
        ["debugfs", "-R", "ls -l /", str(image)], capture_output=True, text=True, check=True
    ).stdout


async def test_from_executable(tmp_path: Path) -> None:
    exe = tmp_path / "envd-build-output"
    exe.write_text("#!/bin/sh\n")
    image = await build_envd_drive(exe, tmp_path / "envd.ext4")
    listing = ls(image)
    assert "aenv-envd" in listing and "100755" in listing
    label = subprocess.run(["e2label", str(image)], capture_output=True, text=True, check=True)
    assert label.stdout.strip() == ENVD_LABEL


async def test_directory_needs_the_entrypoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        await build_envd_drive(tmp_path, tmp_path / "envd.ext4")
