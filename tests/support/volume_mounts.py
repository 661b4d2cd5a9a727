"""Test clean-up of volume images: whatever a test (or a server it ran) left mounted under a
directory is unmounted and its loop devices detached, also after a failure."""

from __future__ import annotations

import subprocess
from pathlib import Path

from aenv.mounts import unmount_under


def release_volume_images(directory: Path) -> None:
    """Unmount every mount under `directory`, then detach loop devices still backed by a file
    under it (`mount -o loop` frees its device at the unmount; one attached without a mount
    is not)."""
    if not directory.exists():
        return
    unmount_under(directory)
    listed = subprocess.run(
        ["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    for line in listed.splitlines():
        name, _, backing = line.strip().partition(" ")
        if Path(backing.strip()).is_relative_to(directory):
            subprocess.run(["losetup", "--detach", name], check=False)


def loop_devices_of(image: Path) -> list[str]:
    """The loop devices backed by `image`."""
    out = subprocess.run(
        ["losetup", "--noheadings", "--output", "NAME", "--associated", str(image)],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return out.split()
