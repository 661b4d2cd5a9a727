"""Incremental memory state for QEMU: a saved VM's RAM as only the pages it changed since the
memory file it maps, kept in the migration stream over that file.

Why this mechanism (issue 18): a restored VM maps its base memory file (a template's, a fork
checkpoint's or a detached pause's) `share=off`, so QEMU 7.2 saves it with every page in the
stream (`x-ignore-shared` skips shared blocks only, and 7.2 has no `mapped-ram`). The kernel here
has no soft-dirty tracking (`CONFIG_MEM_SOFT_DIRTY` is off) and QEMU's dirty bitmaps only live
within one migration. But the private mapping itself tracks writes: a page the guest wrote was
copied on write into an anonymous page, which `/proc/<pid>/pagemap` tells apart from a page still
backed by the file (bit 61 clear). So a save reads that map (≈ 1 MiB of entries for 512 MiB of
RAM, while the vCPUs are stopped), lets QEMU write its usual stream, and keeps only the RAM
records of changed pages (`filter_stream`). Restoring maps the same base file `share=off` and
loads the stream: the pages it carries are written, every other page is the base's.

How the stream reaches the filter (measured on a restored, idle 256 MiB test guest whose stream
is ≈ 100 MiB, busy machine, medians of 8): QEMU writing it into tmpfs scratch took ≈ 80 ms and
the filter's second pass ≈ 35 ms more (≈ 150 ms a save); QEMU writing the same stream into
/dev/null took ≈ 45 ms, which is what QEMU's own walk over the RAM costs. So QEMU migrates into
a pipe and `filter_pipe` keeps the records as they come, on the other core (≈ 120 ms a save):
no tmpfs pages for the stream, no second pass. What remains is QEMU's walk, since QEMU 7.2
cannot leave unchanged pages out of the stream: `x-ignore-shared` skips only shared blocks,
the migration bitmap starts all set, and only virtio-mem discards and virtio-balloon
free-page hints clear bits of it (neither knows which pages are still the file's). A pipe
stream that turns out not to be understood cannot be kept whole (it is gone), so a server's
first save goes through scratch (`filter_file`), and only a QEMU whose stream was understood
migrates into the pipe (`QemuVM.save_delta`).

The changed pages are those since the base memory file. A VM restored from base + delta holds
the delta's pages as anonymous pages again, so its next save would carry them again plus what
changed since: `ramlayers` has the filter also drop the records whose content equals what the
states it was restored from hold (`Same`), so a save holds what changed since the last one, as
a layer over those states. A template build's final state is flattened into a memory file of
its own (`detach.py`, `flatten`), so its sandboxes start from a base with no changed pages to
load.

Stream format (QEMU 7.2, `migration/savevm.c` and `ram.c`): after the header and the
configuration section come the iterative "ram" section's START, PART and END sections, each a
run of records `be64 offset|flags [byte len + block name unless CONTINUE] [payload]` ending in an
EOS record and a footer; then every device's FULL section and EOF, which are copied as they are.
Anything else makes `filter_stream` raise `StreamFormatError`, and the caller keeps the stream
unfiltered (always valid). `index_stream` reads the same layout (where each page's record is),
for comparing with a layer and composing a chain of them (`ramlayers`).
"""

from __future__ import annotations

import bisect
import enum
import mmap
import os
import re
import struct
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

PAGE = 4096
_PM_PRESENT = 1 << 63
_PM_SWAPPED = 1 << 62
_PM_FILE = 1 << 61

_SECTION_START, _SECTION_PART, _SECTION_END, _FOOTER = 0x01, 0x02, 0x03, 0x7E
_ZERO, _MEM_SIZE, _PAGE, _EOS, _CONTINUE = 0x02, 0x04, 0x08, 0x10, 0x20
_KNOWN = _ZERO | _MEM_SIZE | _PAGE | _EOS | _CONTINUE
_FLAGS_MASK = PAGE - 1
_BE64 = struct.Struct(">Q")
_BE32 = struct.Struct(">I")
_MAGIC = b"QEVM"
# The header and configuration section come before the RAM section, within this many bytes.
_PREAMBLE_MAX = 64 * 1024
# What `filter_pipe` reads at once: a Linux pipe holds at most 1 MiB by default.
PIPE_BUFFER = 1 << 20
# Up to 64 CONTINUE records that are zero pages (flags 0x22, one byte) or whole pages (0x28):
# the offset's low bits hold the flags, so the 7th byte has a zero low nibble. Group 1 is the
# run's last record. Short runs, so that one holding a changed page is cheap to walk record by
# record: this takes the filter of a 100 MiB stream from ≈ 70 to ≈ 40 ms.
_RUN = re.compile(
    rb"(?:(.{6}[\x00\x10\x20\x30\x40\x50\x60\x70\x80\x90\xa0\xb0\xc0\xd0\xe0\xf0]"
    rb"(?:\x22\x00|\x28.{4096}))){1,64}",
    re.DOTALL,
)


class StreamFormatError(ValueError):
    """The stream is not laid out as `filter_stream` expects."""


@dataclass(frozen=True)
class DeltaStats:
    pages_kept: int  # RAM records of the filtered block that were kept (changed pages)
    bytes_in: int
    bytes_out: int


def changed_pages(pid: int, memory_file: Path) -> frozenset[int]:
    """Page indexes of `memory_file` that process `pid` maps privately and has written (copied
    on write, or swapped out, which only anonymous pages of such a mapping can be). Blocking."""
    start, end = _mapping(pid, memory_file)
    with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as f:
        f.seek(start // PAGE * 8)
        entries = memoryview(f.read((end - start) // PAGE * 8)).cast("Q")
    return frozenset(
        i
        for i, e in enumerate(entries)
        if (e & _PM_PRESENT and not e & _PM_FILE) or e & _PM_SWAPPED
    )


def _mapping(pid: int, memory_file: Path) -> tuple[int, int]:
    """The address range of `pid`'s mapping of `memory_file` (QEMU maps its RAM file whole)."""
    name = str(memory_file)
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == name:
                low, high = fields[0].split("-")
                return int(low, 16), int(high, 16)
    raise FileNotFoundError(f"process {pid} does not map {memory_file}")


# Whether the record of page `page` (its payload: a whole page, or a zero page's fill byte when
# the bool is True) holds what the state the VM was restored from holds there: then it is
# dropped like an unchanged page (`ramlayers.Parent.same`).
Same = Callable[[int, memoryview, bool], bool]


def filter_file(
    src: Path, dest: Path, block: str, keep: Collection[int], same: Same | None = None
) -> DeltaStats:
    """`filter_stream` from file `src` into a new file `dest`. Blocking."""
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as data:
        parts, stats = filter_stream(memoryview(data), block.encode(), keep, same)
        with open(dest, "wb") as out:
            out.writelines(parts)
        for part in parts:  # slices of the map pin it until released
            if isinstance(part, memoryview):
                part.release()
    return stats


def filter_pipe(
    src: int, dest: Path, block: str, keep: Collection[int], same: Same | None = None
) -> DeltaStats:
    """`filter_stream` from the read end `src` of a pipe into a new file `dest`, as the stream
    arrives: QEMU writes into the pipe while this keeps the changed pages' records, so neither
    the whole stream nor a second pass over it is paid for. Reads until the pipe's end and
    raises `StreamFormatError` (having read it all) if the stream is not understood. Blocking."""
    buf = bytearray(PIPE_BUFFER)
    view = memoryview(buf)
    filled = 0
    ended = False
    parser = _Filter(block.encode(), keep, same)
    try:
        with open(dest, "wb") as out:
            while not ended:
                got = os.readv(src, [view[filled:]])
                ended = got == 0
                filled += got
                if parser.failed is not None:  # drained to the end, for QEMU's sake
                    filled = 0
                    continue
                try:
                    used = parser.parse(view[:filled], ended, out.write)
                except StreamFormatError as exc:
                    parser.failed = exc
                    filled = 0
                    continue
                # The unparsed rest (less than one record) moves to the front.
                view[: filled - used] = bytes(view[used:filled])
                filled -= used
    finally:
        view.release()
    if parser.failed is not None:
        raise parser.failed
    return parser.stats()


def filter_stream(
    data: memoryview, block: bytes, keep: Collection[int], same: Same | None = None
) -> tuple[list[memoryview | bytes], DeltaStats]:
    """The migration stream `data` without the RAM records of block `block` whose page index is
    not in `keep`, nor those `same` says the parent state holds already; returned as pieces to
    write in order. Records of other blocks stay."""
    out: list[memoryview | bytes] = []
    parser = _Filter(block, keep, same)
    parser.parse(data, True, out.append)
    return out, parser.stats()


class _Stage(enum.Enum):
    PREAMBLE = "preamble"  # up to the RAM section's START header
    RECORDS = "records"  # the RAM records of one section
    FOOTER = "footer"  # a RAM section's footer and what follows it
    REST = "rest"  # the devices' sections: copied as they come


class _More(Exception):
    """The buffer ends inside the piece being parsed."""


class _Filter:
    """The stream filter, fed the stream in consecutive buffers (`parse`), one or many."""

    def __init__(self, block: bytes, keep: Collection[int], same: Same | None = None) -> None:
        self.block = block
        self.keep = keep
        self.same = same
        self.wanted = sorted(keep)
        self.stage = _Stage.PREAMBLE
        self.section_id = 0
        self.kept = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.current: bytes | None = None  # the block the input's last record named
        self.last_out: bytes | None = None  # the block the output's last record named
        self.careful = 0  # bytes from here on that go through the loop one record at a time
        self.failed: StreamFormatError | None = None
        self.at = 0  # in `RECORDS`: where the record being parsed starts

    def stats(self) -> DeltaStats:
        return DeltaStats(self.kept, self.bytes_in, self.bytes_out)

    def parse(
        self, data: memoryview, ended: bool, write: Callable[[memoryview | bytes], object]
    ) -> int:
        """Filter what `data` holds, passing the output to `write` in order; returns how much of
        `data` was used (the rest, less than one record or header, comes again at the start of
        the next buffer). `ended`: no more follows, so a piece cut short is an error."""

        def emit(piece: memoryview | bytes) -> None:
            self.bytes_out += len(piece)
            write(piece)

        pos = 0
        try:
            while True:
                if self.stage is _Stage.PREAMBLE:
                    pos = self._preamble(data, ended, emit)
                elif self.stage is _Stage.RECORDS:
                    pos = self._records(data, pos, emit)
                elif self.stage is _Stage.FOOTER:
                    pos = self._footer(data, pos, emit)
                else:
                    emit(data[pos:])
                    pos = len(data)
                    break
        except _More:
            if self.stage is _Stage.RECORDS:
                pos = self.at
            if ended:
                raise StreamFormatError(f"the stream ends inside its {self.stage.value}") from None
        self.bytes_in += pos
        return pos

    def _preamble(
        self, data: memoryview, ended: bool, emit: Callable[[memoryview | bytes], None]
    ) -> int:
        if len(data) < 4 and not ended:
            raise _More
        if bytes(data[:4]) != _MAGIC:
            raise StreamFormatError("not a QEMU migration stream")
        if len(data) < _PREAMBLE_MAX and not ended:
            raise _More
        ram = _find_ram_start(data)
        pos, self.section_id = _section_header(data, ram)
        emit(data[:pos])
        self.stage = _Stage.RECORDS
        return pos

    def _records(
        self, data: memoryview, pos: int, emit: Callable[[memoryview | bytes], None]
    ) -> int:
        """The records of one RAM section, up to and with its EOS record."""
        block, keep, wanted = self.block, self.keep, self.wanted
        unpack = _BE64.unpack_from
        size = len(data)
        while True:
            self.at = pos  # where a record cut short by the buffer's end starts
            if self.current == block and self.careful == 0:
                # Fast path: a run of records of the filtered block, matched in C; when no
                # changed page lies between its first and last page, it goes whole.
                run = _RUN.match(data, pos)
                if run is not None:
                    first = unpack(data, pos)[0] >> 12
                    last = unpack(data, run.start(1))[0] >> 12
                    at = bisect.bisect_left(wanted, first)
                    if _contiguous(run.end() - pos, first, last) and (
                        at == len(wanted) or wanted[at] > last
                    ):
                        pos = run.end()
                        continue
                    self.careful = run.end() - pos
            if pos + 8 > size:
                raise _More
            (word,) = unpack(data, pos)
            flags = word & _FLAGS_MASK
            if flags & ~_KNOWN:
                raise StreamFormatError(f"RAM record flags {flags:#x} at {self.bytes_in + pos}")
            head = pos + 8
            if flags & _MEM_SIZE:  # the block list: copied whole
                end = _skip_block_list(data, head, word & ~_FLAGS_MASK)
                emit(data[pos:end])
                self.careful = max(0, self.careful - (end - pos))
                pos = end
                continue
            if flags & _EOS:
                emit(data[pos:head])
                self.stage = _Stage.FOOTER
                return head
            current = self.current
            if not flags & _CONTINUE:
                if head >= size or head + 1 + data[head] > size:
                    raise _More
                length = data[head]
                current = bytes(data[head + 1 : head + 1 + length])
                head += 1 + length
            if current is None:
                raise StreamFormatError(f"RAM record without a block at {self.bytes_in + pos}")
            if flags & _PAGE:
                end = head + PAGE
            elif flags & _ZERO:
                end = head + 1
            else:
                raise StreamFormatError(f"RAM record flags {flags:#x} at {self.bytes_in + pos}")
            if end > size:
                raise _More
            self.current = current
            self.careful = max(0, self.careful - (end - pos))
            offset = word & ~_FLAGS_MASK
            if current == block and (
                offset // PAGE not in keep
                or (
                    self.same is not None
                    and self.same(offset // PAGE, data[head:end], not flags & _PAGE)
                )
            ):
                pos = end
                continue
            if current == block:
                self.kept += 1
            # Records name their block unless it is the previous record's: dropping records
            # can change which block that is, so every kept record is written anew.
            if current == self.last_out:
                emit(_BE64.pack(offset | (flags | _CONTINUE)))
            else:
                emit(_BE64.pack(offset | (flags & ~_CONTINUE)) + bytes([len(current)]) + current)
            emit(data[head:end])
            self.last_out = current
            pos = end

    def _footer(
        self, data: memoryview, pos: int, emit: Callable[[memoryview | bytes], None]
    ) -> int:
        """The RAM section's footer, then either the next RAM section's header or the end of
        RAM's sections."""
        if pos + 6 > len(data):
            raise _More
        if data[pos] != _FOOTER or _BE32.unpack_from(data, pos + 1)[0] != self.section_id:
            raise StreamFormatError(f"no footer of the RAM section at {self.bytes_in + pos}")
        kind = data[pos + 5]
        if kind not in (_SECTION_PART, _SECTION_END):
            emit(data[pos : pos + 5])
            self.stage = _Stage.REST
            return pos + 5
        if pos + 10 > len(data):
            raise _More
        if _BE32.unpack_from(data, pos + 6)[0] != self.section_id:
            raise StreamFormatError(
                f"a section other than RAM's at {self.bytes_in + pos + 5} before its end"
            )
        emit(data[pos : pos + 10])
        # QEMU starts every section's records with their block name again.
        self.last_out = None
        self.stage = _Stage.RECORDS
        return pos + 10


def _contiguous(length: int, first: int, last: int) -> bool:
    """Whether a run of `length` bytes from page `first` to page `last` can only be one record
    for each page in between, in order (QEMU's first pass over a stopped VM's RAM): n records,
    z of 9 bytes and p of 8 + PAGE, span 9n + (PAGE - 1)p bytes. Otherwise the pages between
    `first` and `last` need not be the run's, and it is walked record by record."""
    count = last - first + 1
    pages, rest = divmod(length - 9 * count, PAGE - 1)
    return count > 0 and rest == 0 and 0 <= pages <= count


def _find_ram_start(data: memoryview) -> int:
    """Where the "ram" section's START header is: the first section after the configuration.
    Its layout (type, be32 id, name, be32 instance 0, be32 version) is found by its name."""
    head = bytes(data[:_PREAMBLE_MAX])
    at = head.find(b"\x03ram\x00\x00\x00\x00")
    if at < 5 or head[at - 5] != _SECTION_START:
        raise StreamFormatError("no RAM section at the start of the stream")
    return at - 5


def _section_header(data: memoryview, pos: int) -> tuple[int, int]:
    """Past a START header at `pos`: the position after it and the section id."""
    (section_id,) = _BE32.unpack_from(data, pos + 1)
    length = data[pos + 5]
    return pos + 6 + length + 8, section_id


def _skip_block_list(data: memoryview, pos: int, total: int) -> int:
    """Past the MEM_SIZE record's block list (name, be64 length, be64 address with
    x-ignore-shared), whose lengths add up to `total`."""
    seen = 0
    while seen < total:
        if pos >= len(data) or pos + 1 + data[pos] + 16 > len(data):
            raise _More
        length = data[pos]
        pos += 1 + length
        (used,) = _BE64.unpack_from(data, pos)
        seen += used
        pos += 16
    if seen != total:
        raise StreamFormatError("the RAM block list does not add up")
    return pos


@dataclass(frozen=True)
class StreamIndex:
    """Where a complete stream's RAM records of one block lie: for each page index, the
    position of its payload (a whole page), or -1 - the fill byte of a zero page (the last
    record of a page wins, as when QEMU loads it); and `records_at`, the end of the START
    section's block list, where more records of the block may be put."""

    pages: dict[int, int]
    records_at: int


def index_stream(data: memoryview, block: bytes) -> StreamIndex:
    """The `StreamIndex` of the whole stream `data` for block `block`; `StreamFormatError`
    unless it is laid out as `filter_stream` expects and complete."""
    try:
        return _index(data, block)
    except (_More, struct.error, IndexError):
        raise StreamFormatError("the stream ends inside its RAM section") from None


def _index(data: memoryview, block: bytes) -> StreamIndex:
    if bytes(data[:4]) != _MAGIC:
        raise StreamFormatError("not a QEMU migration stream")
    pos, section_id = _section_header(data, _find_ram_start(data))
    pages: dict[int, int] = {}
    records_at = -1
    current: bytes | None = None
    while True:
        (word,) = _BE64.unpack_from(data, pos)
        flags = word & _FLAGS_MASK
        if flags & ~_KNOWN:
            raise StreamFormatError(f"RAM record flags {flags:#x} at {pos}")
        head = pos + 8
        if flags & _MEM_SIZE:
            pos = _skip_block_list(data, head, word & ~_FLAGS_MASK)
            records_at = pos if records_at < 0 else records_at
            continue
        if flags & _EOS:
            pos = _next_section(data, head, section_id)
            if pos < 0:
                break
            continue
        if not flags & _CONTINUE:
            current = bytes(data[head + 1 : head + 1 + data[head]])
            head += 1 + data[head]
        if current is None or not flags & (_PAGE | _ZERO):
            raise StreamFormatError(f"RAM record at {pos} is not a page of a named block")
        if current == block:
            pages[word // PAGE] = head if flags & _PAGE else -1 - data[head]
        pos = head + (PAGE if flags & _PAGE else 1)
        if pos > len(data):
            raise _More
    if records_at < 0:
        raise StreamFormatError("the stream has no RAM block list")
    return StreamIndex(pages, records_at)


def _next_section(data: memoryview, pos: int, section_id: int) -> int:
    """Past the footer at `pos` of RAM section `section_id`: where the records of its next
    section start, or -1 after its last."""
    if data[pos] != _FOOTER or _BE32.unpack_from(data, pos + 1)[0] != section_id:
        raise StreamFormatError(f"no footer of the RAM section at {pos}")
    if data[pos + 5] not in (_SECTION_PART, _SECTION_END):
        return -1
    if _BE32.unpack_from(data, pos + 6)[0] != section_id:
        raise StreamFormatError(f"a section other than RAM's at {pos + 5} before its end")
    return pos + 10


def page_record(page: int, payload: bytes | memoryview, block: bytes | None) -> bytes:
    """A RAM record of page `page`: a whole page, or a zero page when `payload` is its one fill
    byte; naming `block`, or continuing the previous record's block when None."""
    flags = _PAGE if len(payload) == PAGE else _ZERO
    if block is None:
        return _BE64.pack(page * PAGE | flags | _CONTINUE) + bytes(payload)
    return _BE64.pack(page * PAGE | flags) + bytes([len(block)]) + block + bytes(payload)
