"""Volumes in the guest: the host's shared directories (virtio-9p devices, one per volume, named
by a tag) mounted at the paths the sandbox asked for, at every `/init` after a boot.

`/init` also runs after restores, when the guest's mounts are already there: a path that is
already a mount point is left alone.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from pydantic import BaseModel, ConfigDict

MOUNTS = Path("/proc/self/mounts")
# The guest init's busybox (guest/init_script.py): present whatever the template image holds.
BUSYBOX = Path("/run/aenv/busybox")
# Larger messages than the 8 KiB default: sequential file I/O is bounded by the message size.
MSIZE = 512 * 1024
OPTIONS = f"trans=virtio,version=9p2000.L,msize={MSIZE},cache=none"


class GuestMount(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tag: str
    path: str


class MountError(OSError):
    """A volume could not be mounted; the message names it and says why."""


def _mounted(path: str) -> bool:
    escaped = path.replace(" ", "\\040")
    return any(line.split()[1] == escaped for line in MOUNTS.read_text().splitlines())


def mount_all(mounts: list[GuestMount]) -> None:
    for mount in mounts:
        if _mounted(mount.path):
            continue
        os.makedirs(mount.path, exist_ok=True)
        done = subprocess.run(
            [str(BUSYBOX), "mount", "-t", "9p", "-o", OPTIONS, mount.tag, mount.path],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise MountError(f"cannot mount volume {mount.tag} at {mount.path}: {done.stderr}")
