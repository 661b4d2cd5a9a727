"""Filesystem helpers shared by the RPC service and `/files`: parent creation owned by the
user, and network-mount detection."""

from __future__ import annotations

import os

from aenv.envd.filesystem.watch import sync_watches
from aenv.envd.users import User

_NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "glusterfs")


def ensure_dirs(path: str, user: User) -> None:
    """Create `path` and its missing parents (0755), each new one owned by `user`.
    Raises NotADirectoryError if a component exists as a file."""
    missing: list[str] = []
    current = path
    while not os.path.isdir(current):
        if os.path.lexists(current):
            raise NotADirectoryError(20, "path is a file", current)
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o755)
        except FileExistsError:
            continue
        os.chown(directory, user.uid, user.gid)
        # Let recursive watches add the new directory before anything is written into it.
        sync_watches()


def is_network_mount(path: str) -> bool:
    """Whether `path` lives on a network filesystem (inotify misses remote changes there)."""
    best, fstype = "", ""
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mountpoint = fields[1].replace("\\040", " ")
                if (path == mountpoint or path.startswith(mountpoint.rstrip("/") + "/")) and len(
                    mountpoint
                ) >= len(best):
                    best, fstype = mountpoint, fields[2]
    except OSError:
        return False
    return fstype.startswith("fuse") or fstype in _NETWORK_FS
