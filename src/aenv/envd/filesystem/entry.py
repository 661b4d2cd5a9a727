"""`EntryInfo` for a path: type, size, mode, Go-style permission string, owner, mtime, symlink
target and `user.e2b.*` xattr metadata, as infra's envd reports them."""

from __future__ import annotations

import grp
import os
import pwd
import stat
from functools import lru_cache

from protobuf.wkt.google.protobuf import timestamp_pb

from aenv.envd.proto.filesystem import filesystem_pb as pb

METADATA_XATTR_PREFIX = "user.e2b."

# Go's os.FileMode.String(): one letter per type/special bit, in this order, then rwx triplets.
_GO_MODE_LETTERS = (
    (stat.S_ISDIR, "d"),
    (stat.S_ISLNK, "L"),
    (lambda m: stat.S_ISBLK(m) or stat.S_ISCHR(m), "D"),
    (stat.S_ISFIFO, "p"),
    (stat.S_ISSOCK, "S"),
)


def go_permissions(mode: int) -> str:
    letters = "".join(letter for test, letter in _GO_MODE_LETTERS if test(mode))
    if mode & stat.S_ISUID:
        letters += "u"
    if mode & stat.S_ISGID:
        letters += "g"
    if stat.S_ISCHR(mode):
        letters += "c"
    if mode & stat.S_ISVTX:
        letters += "t"
    rwx = "".join(c if mode & (1 << (8 - i)) else "-" for i, c in enumerate("rwxrwxrwx"))
    return (letters or "-") + rwx


@lru_cache(maxsize=256)
def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


@lru_cache(maxsize=256)
def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _file_type(mode: int) -> pb.FileType:
    if stat.S_ISREG(mode):
        return pb.FileType.FILE
    if stat.S_ISDIR(mode):
        return pb.FileType.DIRECTORY
    return pb.FileType.UNSPECIFIED


def read_metadata(path: str) -> dict[str, str]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    metadata = {}
    for name in names:
        if name.startswith(METADATA_XATTR_PREFIX):
            try:
                value = os.getxattr(path, name, follow_symlinks=False)
            except OSError:
                continue
            metadata[name[len(METADATA_XATTR_PREFIX) :]] = value.decode(errors="replace")
    return metadata


def write_metadata(path: str, metadata: dict[str, str]) -> None:
    """Replace the file's metadata with `metadata` (an empty dict clears it)."""
    for name in os.listxattr(path):
        if name.startswith(METADATA_XATTR_PREFIX):
            os.removexattr(path, name)
    for key, value in metadata.items():
        os.setxattr(path, METADATA_XATTR_PREFIX + key, value.encode())


def _timestamp(seconds: int, nanos: int) -> timestamp_pb.Timestamp:
    return timestamp_pb.Timestamp(seconds=seconds, nanos=nanos)


def entry_info(path: str, display_path: str | None = None) -> pb.EntryInfo:
    """Describe `path` (raises OSError). A symlink reports its target's type and mode, with
    `is_symlink` and `symlink_target` set, so new and old SDKs both read it correctly."""
    st = os.lstat(path)
    entry = pb.EntryInfo(
        name=os.path.basename(path) or "/",
        path=display_path or path,
        size=st.st_size,
        permissions=go_permissions(st.st_mode),
        owner=_user_name(st.st_uid),
        group=_group_name(st.st_gid),
        modified_time=_timestamp(st.st_mtime_ns // 1_000_000_000, st.st_mtime_ns % 1_000_000_000),
        metadata=read_metadata(path),
    )
    if stat.S_ISLNK(st.st_mode):
        entry.is_symlink = True
        entry.symlink_target = os.path.realpath(path)
        try:
            target = os.stat(path)
        except OSError:
            entry.type = pb.FileType.UNSPECIFIED
        else:
            entry.type = _file_type(target.st_mode)
            entry.mode = stat.S_IMODE(target.st_mode) & 0o777
    else:
        entry.type = _file_type(st.st_mode)
        entry.mode = stat.S_IMODE(st.st_mode) & 0o777
    return entry
