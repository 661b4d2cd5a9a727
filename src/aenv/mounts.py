"""Mounts under a directory the node made and will delete: the bind mounts that put files
from other filesystems into a Firecracker jail, and those a guest image build (debootstrap's
/proc and /sys) leaves when it is cut short. Making one, finding those under a directory (from
/proc/self/mountinfo) and undoing them.

Mounts are made and undone with util-linux's `mount` and `umount`, which every host the node
runs on has. They are only ever undone with their user gone (the jail's process, the build), so
a plain unmount fails only when something else holds a file open; a lazy one then detaches it
anyway, because a tree must never be deleted through a mount.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path


class MountError(RuntimeError):
    """A bind mount could not be made or undone."""


def bind(source: Path, target: Path, *, read_only: bool) -> None:
    """Bind-mount the file `source` onto the existing file `target`."""
    options = ["--bind", "-o", "ro"] if read_only else ["--bind"]
    _run("mount", *options, str(source), str(target))


def mounts_under(directory: Path) -> list[Path]:
    """Mount points at or below `directory` in this mount namespace, deepest first."""
    return [point for point, _ in _mountinfo() if point.is_relative_to(directory)][::-1]


def unmount_under(directory: Path) -> list[Path]:
    """Undo every mount at or below `directory`; returns the mount points undone."""
    undone = []
    for point in mounts_under(directory):
        try:
            _run("umount", str(point))
        except MountError:
            _run("umount", "--lazy", str(point))
        undone.append(point)
    return undone


def is_shared(path: Path) -> bool:
    """Whether the mount holding `path` propagates new mounts to its peers and slaves, so that a
    mount made under it reaches a jail made from it earlier (the jailer's copy is a slave)."""
    resolved = path.resolve()
    # The last mount at the longest prefix is the one the path resolves through.
    holding = [(len(p.parts), s) for p, s in _mountinfo() if resolved.is_relative_to(p)]
    return max(reversed(holding), key=lambda h: h[0])[1] if holding else False


def _mountinfo() -> list[tuple[Path, bool]]:
    """(mount point, shared) of every mount, in mount order."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" ")
        optional = fields[6 : fields.index("-")]
        shared = any(tag.startswith("shared:") for tag in optional)
        out.append((Path(_unescape(fields[4])), shared))
    return out


def _unescape(field: str) -> str:
    # The kernel writes space, tab, newline and backslash in mount points as octal escapes.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise MountError(f"{' '.join(argv)}: {result.stderr.strip() or result.returncode}")
