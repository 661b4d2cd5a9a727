"""A page-fault handler for Firecracker's `Uffd` memory backend: a restored guest's memory served
page by page, as the guest touches it, from a file fetched on demand (a `LazyFile`).

Firecracker's side (its "handling page faults on snapshot resume" document): on
`PUT /snapshot/load` with `mem_backend: {"backend_type": "Uffd", "backend_path": SOCKET}` it
maps anonymous guest memory, registers it with a userfaultfd for missing pages, connects to the
unix socket SOCKET and sends one message: the guest memory regions as JSON,
`[{"base_host_virt_addr": A, "size": S, "offset": O, "page_size": P}, ...]` (`page_size_kib`,
in KiB, before Firecracker 1.10), with the userfaultfd attached (`SCM_RIGHTS`). From then on
a guest access to a page that is not there stops its vCPU until this handler fills the page
from the memory file at `O + (address - A)`: `UFFDIO_COPY` of the page, or `UFFDIO_ZEROPAGE`
for a page of zeros. Pages the balloon gave back (`UFFD_EVENT_REMOVE`) come back as zeros, as
a fresh anonymous page would. A page the source cannot give leaves its vCPU stopped and is
reported to `on_error`, whose owner stops the VM: the guest never reads a wrong page.

The handler listens before the load and serves one VMM; its thread polls the socket, then the
userfaultfd; reads of the source run on the event loop given to `start`. Its owner ends it in
two steps around the VMM's end: `stop_serving` before killing the VMM (a read under way is
cancelled, nothing more is reported, the vCPUs keep waiting), `close` once the VMM is gone (a
userfaultfd closed under a live VMM would let its vCPUs read zeros).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import errno
import fcntl
import json
import logging
import os
import select
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aenv.runtime.driver import MemorySource

log = logging.getLogger("aenv.runtime")

EVENT_PAGEFAULT = 0x12
EVENT_REMOVE = 0x15
_MSG = 32  # sizeof(struct uffd_msg)
POLL_MS = 200  # how soon `close` stops the thread
_SUN_PATH_MAX = 108  # sizeof(sockaddr_un.sun_path), including the terminating NUL


def iowr(number: int, size: int) -> int:
    """Linux's `_IOWR('\\xaa', number, size)`: the userfaultfd ioctls."""
    return (3 << 30) | (size << 16) | (0xAA << 8) | number


UFFDIO_COPY = iowr(0x03, 40)  # struct uffdio_copy: dst, src, len, mode, copy
UFFDIO_ZEROPAGE = iowr(0x04, 32)  # struct uffdio_zeropage: start, len, mode, zeropage


@dataclass(frozen=True)
class Region:
    """One guest memory region as Firecracker describes it."""

    base: int  # host virtual address of its first byte, in the VMM
    size: int
    offset: int  # of its first byte in the memory file
    page_size: int

    @classmethod
    def parse(cls, item: dict[str, int]) -> Region:
        page = item["page_size"] if "page_size" in item else item["page_size_kib"] << 10
        return cls(item["base_host_virt_addr"], item["size"], item["offset"], page)

    def holds(self, address: int) -> bool:
        return self.base <= address < self.base + self.size


class UffdHandler:
    def __init__(
        self,
        source: MemorySource,
        socket_path: Path,
        on_error: Callable[[Exception], None] = lambda _: None,
    ) -> None:
        self.source = source
        self.socket_path = socket_path
        self.on_error = on_error
        self.regions: list[Region] = []
        self.pages_copied = 0
        self.pages_zeroed = 0
        self._removed: list[tuple[int, int]] = []  # [start, end) given back by the balloon
        self._uffd = -1
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._pending: concurrent.futures.Future[bytes] | None = None  # the source's read

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Listen on `socket_path` (which must not exist), before the snapshot load."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            _bind(listener, self.socket_path)
            listener.listen(1)
        except OSError:
            listener.close()
            raise
        self._listener, self._loop = listener, loop
        self._thread = threading.Thread(target=self._run, name="aenv-uffd", daemon=True)
        self._thread.start()

    def stop_serving(self) -> None:
        """Serve and report nothing more (the owner is stopping the VMM); does not block."""
        self._stopping.set()
        pending = self._pending
        if pending is not None:
            pending.cancel()

    def close(self) -> None:
        """Stop serving and let go of the userfaultfd; call it once the VMM is gone (see the
        module docstring). Blocks for up to `POLL_MS`: call it off the event loop."""
        self.stop_serving()
        if self._thread is not None:
            self._thread.join()
        if self._listener is not None:
            self._listener.close()
            self.socket_path.unlink(missing_ok=True)
        if self._uffd >= 0:
            os.close(self._uffd)
            self._uffd = -1

    def _run(self) -> None:
        try:
            if self._handshake():
                self._serve()
        except Exception as error:  # the VMM's vCPUs wait on pages no one will serve now
            if self._stopping.is_set():
                return  # the owner is ending the VMM: a read cut short is no failure
            log.error("uffd handler on %s stops: %s", self.socket_path, error)
            self.on_error(error)

    def _handshake(self) -> bool:
        """Take the VMM's regions and userfaultfd; False when told to stop first."""
        assert self._listener is not None
        while not self._ready(self._listener.fileno()):
            if self._stopping.is_set():
                return False
        connection, _ = self._listener.accept()
        with connection:
            data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 1)
        if len(fds) != 1:
            raise OSError(errno.EPROTO, f"the VMM sent {len(fds)} descriptors, not its uffd")
        self._uffd = fds[0]
        self.regions = [Region.parse(item) for item in json.loads(data)]
        return True

    def _ready(self, fd: int) -> bool:
        waiting = select.poll()
        waiting.register(fd, select.POLLIN)
        return bool(waiting.poll(POLL_MS))

    def _serve(self) -> None:
        while not self._stopping.is_set():
            if not self._ready(self._uffd):
                continue
            try:
                message = os.read(self._uffd, _MSG)
            except BlockingIOError:
                continue  # another reader took it, or a spurious wake
            event = message[0]
            if event == EVENT_PAGEFAULT:
                _, address = struct.unpack_from("=QQ", message, 8)
                self._fault(address)
            elif event == EVENT_REMOVE:
                start, end = struct.unpack_from("=QQ", message, 8)
                self._removed.append((start, end))

    def _fault(self, address: int) -> None:
        region = next((r for r in self.regions if r.holds(address)), None)
        if region is None:
            raise OSError(errno.EFAULT, f"a fault at {address:#x} outside guest memory")
        page = address - (address - region.base) % region.page_size
        if any(start <= page < end for start, end in self._removed):
            self._zero(page, region.page_size)
            return
        assert self._loop is not None
        offset = region.offset + page - region.base
        read = self.source.read(offset, region.page_size)
        self._pending = asyncio.run_coroutine_threadsafe(read, self._loop)
        if self._stopping.is_set():  # `stop_serving` may have looked before it was set
            self._pending.cancel()
        try:
            data = self._pending.result()
        finally:
            self._pending = None
        if data == bytes(len(data)):
            self._zero(page, region.page_size)
        else:
            self._copy(page, data)

    def _copy(self, page: int, data: bytes) -> None:
        buffer = ctypes.create_string_buffer(data, len(data))
        request = bytearray(struct.pack("=QQQQq", page, ctypes.addressof(buffer), len(data), 0, 0))
        if self._ioctl(UFFDIO_COPY, request):
            self.pages_copied += 1

    def _zero(self, page: int, size: int) -> None:
        if self._ioctl(UFFDIO_ZEROPAGE, bytearray(struct.pack("=QQQq", page, size, 0, 0))):
            self.pages_zeroed += 1

    def _ioctl(self, request: int, argument: bytearray) -> bool:
        """True if the page was filled; False if it was there already (another fault's)."""
        try:
            fcntl.ioctl(self._uffd, request, argument, True)
        except OSError as error:
            if error.errno == errno.EEXIST:
                return False
            raise
        return True


def _bind(listener: socket.socket, path: Path) -> None:
    """Bind to `path`, through an open handle on its directory when it is longer than a unix
    socket address holds (107 bytes; a jail's root can be deeper), as `api.py` connects."""
    if len(os.fsencode(str(path))) < _SUN_PATH_MAX:
        listener.bind(str(path))
        return
    directory = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        listener.bind(f"/proc/self/fd/{directory}/{path.name}")
    finally:
        os.close(directory)
