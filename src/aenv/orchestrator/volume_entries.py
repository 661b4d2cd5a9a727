"""A volume's entries as the guests that mount it see them.

The VMM's 9p server (`mapped-xattr`, see `runtime.qemu.SHARE_FILE_MODES`) keeps a guest's owner,
mode and file type in `user.virtfs.*` extended attributes: a symlink, FIFO or device node a
guest makes is a plain host file marked as such, its owner is the xattr's, not the file's. An
entry here reads those marks; `Entry.served` says whether the host may read or write its
content: only plain files and directories are, and a file with one name only (another hard link
may be anywhere).
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from dataclasses import dataclass
from enum import StrEnum

MAX_LINK_TARGET = 4096
_XATTR = "user.virtfs."


class EntryType(StrEnum):
    DIRECTORY = "directory"
    FILE = "file"
    SYMLINK = "symlink"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Entry:
    """One entry as a guest that mounts the volume sees it; `mode` is the permission bits."""

    name: str
    type: EntryType
    path: str
    size: int
    mode: int
    uid: int
    gid: int
    atime: float
    mtime: float
    ctime: float
    target: str | None = None
    # Read or written in place it would reach more than this name (see the module docstring).
    served: bool = True


@dataclass(frozen=True)
class Owner:
    """What a write or a metadata change sets; None keeps the current value."""

    uid: int | None = None
    gid: int | None = None
    mode: int | None = None


def _mapped(dir_fd: int, name: str) -> dict[str, int]:
    """The guest's owner, mode and device number of `name` in `dir_fd`, from the extended
    attributes the VMM's 9p server keeps; the magic link names the directory already open, and
    `name` itself is not followed."""
    found = {}
    where = f"/proc/self/fd/{dir_fd}/{name}"
    for key, size in (("uid", 4), ("gid", 4), ("mode", 4)):
        try:
            raw = os.getxattr(where, _XATTR + key, follow_symlinks=False)
        except OSError as e:
            if e.errno in (errno.ENODATA, errno.ENOTSUP):
                continue
            raise
        if len(raw) == size:
            found[key] = struct.unpack("<I", raw)[0]
    return found


def set_mapped(fd: int, kind: int, owner: Owner) -> None:
    """Record `owner` as the guest sees it on the open file `fd` of type `kind` (S_IFREG...)."""
    path = f"/proc/self/fd/{fd}"
    for key, value in (("uid", owner.uid), ("gid", owner.gid)):
        if value is not None:
            os.setxattr(path, _XATTR + key, struct.pack("<I", value))
    if owner.mode is not None:
        os.setxattr(path, _XATTR + "mode", struct.pack("<I", kind | owner.mode))


def _guest_type(mode: int) -> EntryType:
    if stat.S_ISDIR(mode):
        return EntryType.DIRECTORY
    if stat.S_ISREG(mode):
        return EntryType.FILE
    if stat.S_ISLNK(mode):
        return EntryType.SYMLINK
    return EntryType.UNKNOWN


def _link_text(dir_fd: int, name: str) -> str:
    """What a guest symlink (a host file holding its target) points at."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.read(fd, MAX_LINK_TARGET).decode(errors="replace")
    finally:
        os.close(fd)


def entry_at(dir_fd: int, name: str, path: str) -> Entry:
    """The entry `name` of the directory `dir_fd` (never followed), shown as `path`."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    mode, uid, gid, target = st.st_mode, st.st_uid, st.st_gid, None
    host_plain = stat.S_ISREG(mode) or stat.S_ISDIR(mode)
    if host_plain:
        mapped = _mapped(dir_fd, name)
        uid, gid = mapped.get("uid", uid), mapped.get("gid", gid)
        # Only a plain host file can stand for another type; a directory stays one.
        if "mode" in mapped and (stat.S_ISREG(mode) or stat.S_ISDIR(mapped["mode"])):
            mode = mapped["mode"]
    kind = _guest_type(mode)
    if kind is EntryType.SYMLINK:
        target = _link_text(dir_fd, name) if host_plain else os.readlink(name, dir_fd=dir_fd)
    served = host_plain and kind in (EntryType.FILE, EntryType.DIRECTORY)
    if kind is EntryType.FILE and st.st_nlink > 1:
        served = False
    return Entry(
        name=name,
        type=kind,
        path=path,
        size=st.st_size,
        mode=stat.S_IMODE(mode),
        uid=uid,
        gid=gid,
        atime=st.st_atime,
        mtime=st.st_mtime,
        ctime=st.st_ctime,
        target=target,
        served=served,
    )
