"""Firecracker's side of its `Uffd` memory backend, for the test double (`fc_peer.py`): guest
memory as anonymous memory registered with a userfaultfd for missing pages, handed to the page
fault handler listening on a unix socket as Firecracker hands it over: one message, the regions
as JSON (`base_host_virt_addr`, `size`, `offset`, `page_size`), the userfaultfd attached. A read
of a page not there yet waits for the handler to fill it, as a vCPU would. Needs root (this
kernel's `vm.unprivileged_userfaultfd` is 0)."""

from __future__ import annotations

import ctypes
import fcntl
import json
import mmap
import os
import socket
import struct
from pathlib import Path

from aenv.runtime.firecracker.uffd import iowr

SYS_USERFAULTFD = 323  # x86-64
UFFD_API = 0xAA
UFFDIO_API = iowr(0x3F, 24)
UFFDIO_REGISTER = iowr(0x00, 32)
REGISTER_MODE_MISSING = 1
PAGE = 4096


class GuestMemory:
    def __init__(self, size: int, handler: Path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.uffd = libc.syscall(SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK)
        if self.uffd < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"userfaultfd: {os.strerror(code)}")
        fcntl.ioctl(self.uffd, UFFDIO_API, bytearray(struct.pack("=QQQ", UFFD_API, 0, 0)), True)
        self.size = size
        self.memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view = ctypes.c_char.from_buffer(self.memory)
        base = ctypes.addressof(self._view)
        register = bytearray(struct.pack("=QQQQ", base, size, REGISTER_MODE_MISSING, 0))
        fcntl.ioctl(self.uffd, UFFDIO_REGISTER, register, True)
        regions = [{"base_host_virt_addr": base, "size": size, "offset": 0, "page_size": PAGE}]
        # Through a handle on its directory: a path as deep as a jail's in a test's temporary
        # directory is longer than a unix socket address (Firecracker, chrooted, has it short).
        directory = os.open(handler.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.connect(f"/proc/self/fd/{directory}/{handler.name}")
                socket.send_fds(connection, [json.dumps(regions).encode()], [self.uffd])
        finally:
            os.close(directory)

    def read(self, offset: int, length: int) -> bytes:
        """What the guest reads there: waits for the handler on each page not there yet.
        Copied by a C call that lets go of the GIL: a fault taken while holding it would stop
        every Python thread, the handler's too."""
        buffer = ctypes.create_string_buffer(length)
        ctypes.memmove(buffer, ctypes.addressof(self._view) + offset, length)
        return buffer.raw

    def close(self) -> None:
        """Give the userfaultfd up, as an exiting Firecracker does: reads waiting on a page go
        on (anonymous memory: zeros)."""
        os.close(self.uffd)
