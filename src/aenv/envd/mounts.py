"""Volumes in the guest: the host's shared directories (virtio-9p devices, one per volume, named
by a tag) mounted at the paths the sandbox asked for, at every `/init` after a boot or restore.

A guest is saved with its memory only while none of its 9p devices is mounted (QEMU refuses to
save a mounted one), so before such a save the host has envd `release` its volumes: each is
unmounted and its path covered by an empty read-only tmpfs, a *placeholder*, so that what a
process writes there meanwhile fails (EROFS) rather than landing on the root filesystem under
the mount point. A volume something holds (an open file, a working directory) cannot be
unmounted: the release then mounts back what it had released and raises `VolumeBusy`, and the
host saves the filesystem only. A holder that goes away by itself is waited for a moment (a
file envd has just served is closed after its last byte is sent, when the client may already
ask for the save). `mount_all` (at `/init` after the restore, or on the source
after its save) puts each volume back in place of its placeholder, and removes placeholders at
paths it is not asked to mount (a sandbox created from the snapshot of one with volumes mounts
only those its own create asks for); placeholders are detached, so one a process entered
during the save does not stand in the way. A path where the volume is mounted already is left
alone.

mount(2) and umount2(2) are called directly: a process start costs ≈ 0.5 s in a guest under
emulation, on the path of every pause of a sandbox with volumes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

MOUNTS = Path("/proc/self/mounts")
# Larger messages than the 8 KiB default: sequential file I/O is bounded by the message size.
MSIZE = 512 * 1024
OPTIONS = f"trans=virtio,version=9p2000.L,msize={MSIZE},cache=none"
# The source name of placeholder mounts, as /proc/self/mounts shows it.
PLACEHOLDER = "aenv-released"
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_PLACEHOLDER_FLAGS = _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
# Volumes are shared with other sandboxes (and the volume content API): a set-uid binary or a
# device node one guest's root plants there must give no other guest's users root or a raw
# device. Programs in volumes still run.
VOLUME_FLAGS = _MS_NOSUID | _MS_NODEV
_MNT_DETACH = 2
# How long an unmount retries a volume in use before the release gives up.
BUSY_WAIT = 1.0
_libc = ctypes.CDLL(None, use_errno=True)


class GuestMount(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tag: str
    path: str


class MountError(OSError):
    """A volume could not be mounted or released; the message names it and says why."""


class VolumeBusy(MountError):
    """A volume is in use and cannot be unmounted; nothing was released."""


def mount_all(mounts: list[GuestMount]) -> None:
    wanted = {m.path for m in mounts}
    for path, source in _tops().items():
        if source == PLACEHOLDER and path not in wanted:
            _detach(path)
    for mount in mounts:
        top = _tops().get(mount.path)
        if top == mount.tag:
            continue
        if top == PLACEHOLDER:
            _detach(mount.path)
        os.makedirs(mount.path, exist_ok=True)
        _mount(mount.tag, mount.path, "9p", VOLUME_FLAGS, OPTIONS, f"volume {mount.tag}")


def release_all(mounts: list[GuestMount]) -> None:
    """Unmount every volume of `mounts` (wherever it is mounted) and cover each of their paths
    with a placeholder; raises `VolumeBusy`, with all of them mounted as before, when one is in
    use."""
    tags = {m.tag for m in mounts}
    released: list[GuestMount] = []
    try:
        for path, source in reversed(_tops().items()):
            if source in tags:
                _umount_when_free(path, f"volume {source}")
                released.append(GuestMount(tag=source, path=path))
        tops = _tops()
        for mount in mounts:
            if tops.get(mount.path) != PLACEHOLDER:
                os.makedirs(mount.path, exist_ok=True)
                options = "size=4k,mode=0555"
                _mount(PLACEHOLDER, mount.path, "tmpfs", _PLACEHOLDER_FLAGS, options, "placeholder")
    except MountError:
        mount_all(released)
        raise


def _tops() -> dict[str, str]:
    """Mount point -> source of the mount on top there, in mount order."""
    tops: dict[str, str] = {}
    for line in MOUNTS.read_text().splitlines():
        source, path = (_unescape(field) for field in line.split()[:2])
        tops.pop(path, None)  # the later mount is on top: keep the order of the tops
        tops[path] = source
    return tops


def _unescape(field: str) -> str:
    """A /proc/self/mounts field: space, tab, newline and backslash appear as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mount(source: str, target: str, fstype: str, flags: int, data: str, what: str) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()):
        err = ctypes.get_errno()
        raise MountError(err, f"cannot mount {what} at {target}: {os.strerror(err)}")


def _umount_when_free(target: str, what: str) -> None:
    deadline = time.monotonic() + BUSY_WAIT
    delay = 0.01
    while True:
        try:
            return _umount(target, what)
        except VolumeBusy:
            if time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def _detach(placeholder: str) -> None:
    """Remove a placeholder even when a process is in it (one that entered it during a save
    keeps it as its working directory, empty and read-only, when the volume comes back)."""
    _umount(placeholder, "placeholder", _MNT_DETACH)


def _umount(target: str, what: str, flags: int = 0) -> None:
    if _libc.umount2(target.encode(), flags):
        err = ctypes.get_errno()
        message = f"cannot unmount {what} at {target}: {os.strerror(err)}"
        raise (VolumeBusy if err == errno.EBUSY else MountError)(err, message)
