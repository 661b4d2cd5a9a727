"""Opening paths strictly beneath a directory: Linux's `openat2` with `RESOLVE_BENEATH`.

The server runs as root and serves files of directories that guests write into (volumes), so
every path it opens there is resolved by the kernel, not by string checks: `RESOLVE_BENEATH`
refuses `..` and absolute steps out of the directory, `RESOLVE_NO_SYMLINKS` refuses every
symlink (also one a guest swaps in between a check and the open), `RESOLVE_NO_MAGICLINKS` the
/proc kind and `RESOLVE_NO_XDEV` a mount point inside. Python has no binding for `openat2`
(and PyPI no maintained one), hence the direct system call through ctypes.
"""

from __future__ import annotations

import ctypes
import os

# The system call's number is the same on every architecture with the generic table (x86-64
# and arm64 alike): it came after the tables were unified.
_SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
STRICT = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


def open_beneath(root_fd: int, path: str, flags: int, mode: int = 0) -> int:
    """A file descriptor for `path` (relative) under the directory `root_fd`, resolved with
    `STRICT`. Raises `OSError`: `EXDEV` for a step out of the directory or across a mount,
    `ELOOP` for a symlink on the way or at the end, else what `open` raises."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, STRICT)
    fd = _libc.syscall(
        _SYS_OPENAT2,
        ctypes.c_int(root_fd),
        ctypes.c_char_p(os.fsencode(path or ".")),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{path}: {os.strerror(err)}")
    return int(fd)
