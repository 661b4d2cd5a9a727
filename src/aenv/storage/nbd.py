"""A read-only NBD server on a unix socket, over any `BlockSource` (a `LazyFile`): how QEMU's
own NBD client (`driver=nbd`, no kernel module, no `/dev/nbd*`) reads a disk image that is
fetched as it is read.

The protocol is the NBD protocol's fixed newstyle negotiation (`NBD_OPT_GO`, `NBD_OPT_INFO`,
`NBD_OPT_EXPORT_NAME`, `NBD_OPT_LIST`, `NBD_OPT_ABORT`; other options are refused as
unsupported, so clients fall back to simple replies) and, once an export is chosen, reads with
simple replies. Reads of one connection run at once (up to `IN_FLIGHT`), their replies sent as
each finishes (the client matches them by handle), so one read waiting for its chunk does not
hold up reads of chunks already here. Writes, trims and zeroing are refused with `EPERM`: the
export is read-only, its writes go to the qcow2 layer above it. A read whose data cannot be had
is answered `EIO`, never zeros, and reported to `on_error`, whose owner fails the sandbox with
the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

log = logging.getLogger("aenv.nbd")

NBDMAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
OPTION_REPLY_MAGIC = 0x3E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698

FLAG_FIXED_NEWSTYLE = 1 << 0
FLAG_NO_ZEROES = 1 << 1
# Transmission flags: flags are sent, the export is read-only, several connections may read.
TRANSMISSION = (1 << 0) | (1 << 1) | (1 << 8)

OPT_EXPORT_NAME = 1
OPT_ABORT = 2
OPT_LIST = 3
OPT_INFO = 6
OPT_GO = 7
REP_ACK = 1
REP_SERVER = 2
REP_INFO = 3
REP_ERR_UNSUP = (1 << 31) + 1
REP_ERR_INVALID = (1 << 31) + 3
REP_ERR_UNKNOWN = (1 << 31) + 6
INFO_EXPORT = 0
INFO_BLOCK_SIZE = 3

CMD_READ = 0
CMD_WRITE = 1
CMD_DISC = 2
CMD_FLUSH = 3
EPERM = 1
EIO = 5
EINVAL = 22

MAX_OPTION = 4096  # longer option data is no option we know
MAX_READ = 32 << 20  # as advertised in NBD_INFO_BLOCK_SIZE
IN_FLIGHT = 16
_REQUEST = struct.Struct(">IHHQQI")
_REPLY = struct.Struct(">IIQ")


class BlockSource(Protocol):
    @property
    def size(self) -> int: ...

    async def read(self, offset: int, length: int) -> bytes:
        """Exactly `length` bytes at `offset` (inside `size`); raises on failure."""
        ...


class Closed(Exception):
    """The client went away, or broke the protocol: the connection ends."""


class NbdExport:
    """One read-only export named `name` of `source`, served to every client that connects."""

    def __init__(
        self,
        source: BlockSource,
        name: str = "",
        on_error: Callable[[Exception], None] = lambda _: None,
    ) -> None:
        self.source = source
        self.name = name
        self.on_error = on_error

    async def serve(self, socket: Path) -> asyncio.Server:
        """Listen on the unix socket `socket` (which must not exist); close the server to stop."""
        return await asyncio.start_unix_server(self._connection, path=str(socket))

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if await self._negotiate(reader, writer):
                await self._transmit(reader, writer)
        except (Closed, asyncio.IncompleteReadError, ConnectionError) as error:
            log.debug("nbd connection ends: %r", error)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _negotiate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Options until one chooses the export (True) or the client aborts (False)."""
        writer.write(struct.pack(">QQH", NBDMAGIC, IHAVEOPT, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES))
        (client_flags,) = struct.unpack(">I", await reader.readexactly(4))
        if not client_flags & FLAG_FIXED_NEWSTYLE:
            raise Closed("the client does not speak fixed newstyle")
        while True:
            magic, option, length = struct.unpack(">QII", await reader.readexactly(16))
            if magic != IHAVEOPT or length > MAX_OPTION:
                raise Closed("not an option")
            data = await reader.readexactly(length)
            if option == OPT_EXPORT_NAME:
                if data.decode(errors="replace") != self.name:
                    raise Closed("no such export")  # this option has no error reply
                tail = b"" if client_flags & FLAG_NO_ZEROES else bytes(124)
                writer.write(struct.pack(">QH", self.source.size, TRANSMISSION) + tail)
                return True
            if option == OPT_ABORT:
                self._reply(writer, option, REP_ACK)
                await writer.drain()
                return False
            if option == OPT_LIST:
                name = self.name.encode()
                self._reply(writer, option, REP_SERVER, struct.pack(">I", len(name)) + name)
                self._reply(writer, option, REP_ACK)
            elif option in (OPT_INFO, OPT_GO):
                if self._info(writer, option, data) and option == OPT_GO:
                    return True
            else:
                self._reply(writer, option, REP_ERR_UNSUP)
            await writer.drain()

    def _info(self, writer: asyncio.StreamWriter, option: int, data: bytes) -> bool:
        """Answer NBD_OPT_INFO or NBD_OPT_GO; True if it named this export."""
        try:
            (length,) = struct.unpack_from(">I", data)
            name = data[4 : 4 + length].decode()
            (requests,) = struct.unpack_from(">H", data, 4 + length)
            if len(data) != 4 + length + 2 + 2 * requests:
                raise ValueError("length")
        except (struct.error, ValueError, UnicodeDecodeError):
            self._reply(writer, option, REP_ERR_INVALID)
            return False
        if name != self.name:
            self._reply(writer, option, REP_ERR_UNKNOWN, f"no export {name!r}".encode())
            return False
        export = struct.pack(">HQH", INFO_EXPORT, self.source.size, TRANSMISSION)
        self._reply(writer, option, REP_INFO, export)
        sizes = struct.pack(">HIII", INFO_BLOCK_SIZE, 1, 4096, MAX_READ)
        self._reply(writer, option, REP_INFO, sizes)
        self._reply(writer, option, REP_ACK)
        return True

    @staticmethod
    def _reply(writer: asyncio.StreamWriter, option: int, kind: int, data: bytes = b"") -> None:
        writer.write(struct.pack(">QIII", OPTION_REPLY_MAGIC, option, kind, len(data)) + data)

    async def _transmit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        slots = asyncio.Semaphore(IN_FLIGHT)
        reads: set[asyncio.Task[None]] = set()
        try:
            while True:
                request = await reader.readexactly(_REQUEST.size)
                magic, _, command, handle, offset, length = _REQUEST.unpack(request)
                if magic != REQUEST_MAGIC:
                    raise Closed("not a request")
                if command == CMD_DISC:
                    return
                if command == CMD_READ:
                    await slots.acquire()
                    task = asyncio.create_task(self._read(writer, handle, offset, length))
                    reads.add(task)

                    def done(task: asyncio.Task[None]) -> None:
                        reads.discard(task)
                        slots.release()

                    task.add_done_callback(done)
                    continue
                if command == CMD_WRITE:
                    await reader.readexactly(length)  # the payload, refused
                error = 0 if command == CMD_FLUSH else EPERM
                writer.write(_REPLY.pack(SIMPLE_REPLY_MAGIC, error, handle))
                await writer.drain()
        finally:
            for task in reads:
                task.cancel()
            await asyncio.gather(*reads, return_exceptions=True)

    async def _read(
        self, writer: asyncio.StreamWriter, handle: int, offset: int, length: int
    ) -> None:
        if length > MAX_READ or offset + length > self.source.size:
            writer.write(_REPLY.pack(SIMPLE_REPLY_MAGIC, EINVAL, handle))
            return
        try:
            data = await self.source.read(offset, length)
            if len(data) != length:
                raise OSError(f"the source gave {len(data)} bytes of {length}")
        except Exception as error:
            log.error("nbd read of %d bytes at %d failed: %s", length, offset, error)
            self.on_error(error)
            writer.write(_REPLY.pack(SIMPLE_REPLY_MAGIC, EIO, handle))
            return
        # One write call: the header and its data go out together, between other replies.
        writer.write(_REPLY.pack(SIMPLE_REPLY_MAGIC, 0, handle) + data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
