"""ext4 images from a directory without mounting, and the cached Debian base rootfs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from aenv.guest.cmdline import ROOT_LABEL, GuestNet, kernel_cmdline
from aenv.guest.rootfs import build_base_rootfs, make_ext4
from tests.support.guest import GUEST_CACHE, MIRROR

REPO = Path(__file__).resolve().parents[2]


def debugfs(image: Path, request: str) -> str:
    return subprocess.run(
        ["debugfs", "-R", request, str(image)], capture_output=True, check=True, text=True
    ).stdout


async def test_image_from_directory(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "hello").write_text("hi there\n")
    image = await make_ext4(tree, tmp_path / "img.ext4", label="test-label", read_only=True)
    assert debugfs(image, "cat /etc/hello") == "hi there\n"
    label = subprocess.run(["e2label", str(image)], capture_output=True, text=True, check=True)
    assert label.stdout.strip() == "test-label"


def test_cmdline_carries_the_network() -> None:
    line = kernel_cmdline(GuestNet("10.0.2.15/24", "10.0.2.2", "1.1.1.1"), hostname="sb")
    assert "aenv.ip=10.0.2.15/24 aenv.gw=10.0.2.2 aenv.dns=1.1.1.1" in line
    assert "aenv.hostname=sb" in line and "console=ttyS0" in line


@pytest.mark.slow
async def test_base_rootfs() -> None:
    base = await build_base_rootfs(GUEST_CACHE, MIRROR)
    passwd = (base.tree / "etc" / "passwd").read_text()
    assert (base.tree / "etc" / "resolv.conf").read_text() == ""  # not the build host's
    assert "user:x:1000:1000::/home/user:/bin/bash" in passwd
    assert (base.tree / "etc" / "sudoers.d" / "user").read_text().strip().endswith("NOPASSWD:ALL")
    for tool in ("bash", "python3", "git", "sudo", "curl", "ip"):
        assert any((base.tree / d / tool).exists() for d in ("usr/bin", "usr/sbin", "bin", "sbin"))
    assert (
        ROOT_LABEL
        in subprocess.run(
            ["e2label", str(base.image)], capture_output=True, text=True, check=True
        ).stdout
    )
