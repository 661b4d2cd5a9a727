"""One lazily fetched file (a `LazyFile`) as a file on a FUSE mount of its own, so a VMM can map
it as guest memory and have each page filled on its first touch.

A restored QEMU guest maps its memory file privately (`memory-backend-file`, `share=off`): its
pages are read through page faults of that mapping, which the kernel turns into reads of the
file. On this mount such a read is a FUSE `READ`, answered from the `LazyFile` (its chunk
fetched from the node's cache, a peer or the store on first need), so the VMM starts before the
memory is here. The kernel keeps what was read in its page cache (`FOPEN_KEEP_CACHE`): a page
is asked for once. No libfuse: the FUSE protocol is spoken here over `/dev/fuse` (Linux's
`include/uapi/linux/fuse.h`, protocol 7.31), which needs root to mount.

The file system has a root directory and the one file, whose content never changes. Opening it
for writing succeeds, because QEMU 7.2 opens every memory backend read-write, but a `WRITE` is
refused (`EROFS`): a private mapping never writes back. A `SETATTR` (the jail's chown and
chmod) changes nothing and answers the attributes as they are; the mount is `allow_other`
without `default_permissions`, so access is governed by what sees the mount (a VMM's jail),
not by modes. A `READ` that fails is answered `EIO`: the faulting VMM gets `SIGBUS`, never a
page of zeros.

Requests are read by a thread of this object's; reads run on the event loop given to `mount`,
but a read the source can answer at once (`read_present`: a `LazyFile`'s chunks already local)
is answered on that thread.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import select
import stat
import struct
import threading
from pathlib import Path
from typing import Protocol

log = logging.getLogger("aenv.fuse")

ROOT = 1
FILE = 2
MAX_PAGES = 256  # pages per READ: 1 MiB, the repository's chunk
_BUFFER = MAX_PAGES * 4096 + 4096  # a request, a WRITE's data included
_FOREVER = 1 << 32  # seconds the kernel may keep names and attributes: they never change
POLL_MS = 200  # how soon `unmount` stops the reader thread

LOOKUP, FORGET, GETATTR, SETATTR = 1, 2, 3, 4
OPEN, READ, WRITE, STATFS, RELEASE = 14, 15, 16, 17, 18
FLUSH, INIT, OPENDIR, RELEASEDIR = 25, 26, 27, 29
ACCESS, INTERRUPT, DESTROY, BATCH_FORGET = 34, 36, 38, 42
_NO_REPLY = frozenset({FORGET, INTERRUPT, BATCH_FORGET})
ASYNC_READ = 1 << 0
BIG_WRITES = 1 << 5
MAX_PAGES_FLAG = 1 << 22
KEEP_CACHE = 1 << 1

_IN_HEADER = struct.Struct("=IIQQIIIHH")
_OUT_HEADER = struct.Struct("=IiQ")
_READ_IN = struct.Struct("=QQIIQII")
_ATTR = struct.Struct("=QQQQQQIIIIIIIIII")

MS_NOSUID, MS_NODEV = 2, 4
SOURCE = "aenv-lazy"  # the mounts' source in mountinfo, by which a sweep finds them
MNT_DETACH = 2


class ByteSource(Protocol):
    @property
    def size(self) -> int: ...

    async def read(self, offset: int, length: int) -> bytes: ...


class FuseFile:
    """`source` as the file `name` at the root of a FUSE mount (see the module docstring)."""

    def __init__(self, source: ByteSource, name: str) -> None:
        self.source = source
        self.name = name
        self.mountpoint: Path | None = None
        self._fd = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._detached = False

    @property
    def path(self) -> Path:
        """The file on the mount."""
        assert self.mountpoint is not None, "not mounted"
        return self.mountpoint / self.name

    def mount(self, mountpoint: Path, loop: asyncio.AbstractEventLoop) -> None:
        """Mount on the empty directory `mountpoint` (root only); raises `OSError`."""
        self._fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        options = f"fd={self._fd},rootmode=40000,user_id=0,group_id=0,allow_other"
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mount(SOURCE.encode(), bytes(mountpoint), b"fuse", MS_NOSUID | MS_NODEV,
                      options.encode()) != 0:  # fmt: skip
            code = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(code, f"mounting FUSE on {mountpoint}: {os.strerror(code)}")
        self.mountpoint, self._loop = mountpoint, loop
        self._thread = threading.Thread(target=self._serve, name="aenv-fuse", daemon=True)
        self._thread.start()

    def detach(self) -> None:
        """Take the mount out of the file tree and go on serving: who opened or mapped the
        file keeps reading it, no one can open it any more (a lazy unmount)."""
        if self.mountpoint is None or self._detached:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.umount2(bytes(self.mountpoint), MNT_DETACH) != 0:
            log.warning("unmounting %s: %s", self.mountpoint, os.strerror(ctypes.get_errno()))
        self._detached = True

    def unmount(self) -> None:
        """Detach the mount and stop serving. Call it once nothing maps the file any more: the
        connection ends with it, and a page not read yet can no longer be."""
        if self.mountpoint is None:
            return
        self.detach()
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        os.close(self._fd)
        self.mountpoint = None

    def _serve(self) -> None:
        waiting = select.poll()
        waiting.register(self._fd, select.POLLIN)
        while not self._stopping.is_set():
            # Polled, not blocked in read: a read blocked on the device outlives its close.
            if not waiting.poll(POLL_MS):
                continue
            try:
                request = os.read(self._fd, _BUFFER)
            except OSError as failure:
                if failure.errno in (errno.EINTR, errno.ENOENT, errno.EAGAIN):
                    continue  # interrupted, or a request the kernel withdrew
                return  # ENODEV: unmounted; EBADF: closed by `unmount`
            length, opcode, unique, node, *_ = _IN_HEADER.unpack_from(request)
            body = request[_IN_HEADER.size : length]
            if opcode in _NO_REPLY:
                continue
            if opcode == READ:
                _, offset, size, *_ = _READ_IN.unpack_from(body)
                if (data := self._read_present(offset, size)) is not None:
                    self._reply(unique, 0, data)
                    continue
                assert self._loop is not None
                asyncio.run_coroutine_threadsafe(self._read(unique, offset, size), self._loop)
                continue
            code, payload = self._answer(opcode, node, body)
            self._reply(unique, code, payload)
            if opcode == DESTROY:
                return

    def _answer(self, opcode: int, node: int, body: bytes) -> tuple[int, bytes]:
        """(0 or an errno, the reply) for every request but READ."""
        if opcode == INIT:
            return 0, self._init(body)
        if opcode == LOOKUP:
            if node != ROOT or body.rstrip(b"\0").decode(errors="replace") != self.name:
                return errno.ENOENT, b""
            return 0, struct.pack("=QQQQII", FILE, 0, _FOREVER, _FOREVER, 0, 0) + self._attr(FILE)
        if opcode in (GETATTR, SETATTR):
            return 0, struct.pack("=QII", _FOREVER, 0, 0) + self._attr(node)
        if opcode == OPEN:
            return 0, struct.pack("=QII", 0, KEEP_CACHE, 0)
        if opcode == OPENDIR:
            return 0, struct.pack("=QII", 0, 0, 0)
        if opcode in (RELEASE, RELEASEDIR, FLUSH, ACCESS, DESTROY):
            return 0, b""
        if opcode == WRITE:
            return errno.EROFS, b""
        if opcode == STATFS:
            blocks = -(-self.source.size // 4096)
            return 0, struct.pack("=QQQQQIIII6I", blocks, 0, 0, 2, 0, 4096, 255, 4096, 0,
                                  *(0,) * 6)  # fmt: skip
        return errno.ENOSYS, b""

    def _init(self, body: bytes) -> bytes:
        major, minor, readahead, offered = struct.unpack_from("=IIII", body)
        if major != 7:
            raise OSError(errno.EPROTO, f"FUSE protocol {major}.{minor}: 7 is spoken here")
        flags = offered & (ASYNC_READ | BIG_WRITES | MAX_PAGES_FLAG)
        return struct.pack(
            "=IIIIHHIIHHI7I", 7, 31, min(readahead, MAX_PAGES * 4096), flags, 16, 12,
            MAX_PAGES * 4096, 1, MAX_PAGES, 0, 0, *(0,) * 7,
        )  # fmt: skip

    def _attr(self, node: int) -> bytes:
        if node == ROOT:
            return _ATTR.pack(ROOT, 0, 0, 0, 0, 0, 0, 0, 0, stat.S_IFDIR | 0o755, 2, 0, 0, 0,
                              4096, 0)  # fmt: skip
        size = self.source.size
        return _ATTR.pack(FILE, size, -(-size // 512), 0, 0, 0, 0, 0, 0, stat.S_IFREG | 0o644,
                          1, 0, 0, 0, 4096, 0)  # fmt: skip

    def _read_present(self, offset: int, size: int) -> bytes | None:
        """The READ answered on this thread, when the source can at once (`read_present`:
        its data is local): a VMM's fault then waits for no event loop."""
        read_present = getattr(self.source, "read_present", None)
        if read_present is None:
            return None
        data: bytes | None = read_present(offset, min(size, max(0, self.source.size - offset)))
        return data

    async def _read(self, unique: int, offset: int, size: int) -> None:
        try:
            data = await self.source.read(offset, min(size, max(0, self.source.size - offset)))
        except Exception as error:  # any failure is the reader's EIO
            log.error("FUSE read of %d bytes at %d failed: %s", size, offset, error)
            self._reply(unique, errno.EIO, b"")
            return
        self._reply(unique, 0, data)

    def _reply(self, unique: int, error: int, payload: bytes) -> None:
        header = _OUT_HEADER.pack(_OUT_HEADER.size + len(payload), -error, unique)
        try:
            os.write(self._fd, header + payload)
        except OSError as failure:  # the request was interrupted, or the mount is gone
            log.debug("FUSE reply to %d not taken: %s", unique, failure)
