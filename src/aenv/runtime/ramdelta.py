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

The delta is always against the base memory file, not against the previous save: a VM restored
from base + delta holds the delta's pages as anonymous pages again, so its next save carries
them plus whatever changed since. A chain never grows deeper than one layer (no flattening is
needed); the layer grows only with what the guest changed. A template build's final state is
flattened into a memory file of its own (`detach.py`, `flatten`), so its sandboxes start from a
base with no changed pages to load.

Stream format (QEMU 7.2, `migration/savevm.c` and `ram.c`): after the header and the
configuration section come the iterative "ram" section's START, PART and END sections, each a
run of records `be64 offset|flags [byte len + block name unless CONTINUE] [payload]` ending in an
EOS record and a footer; then every device's FULL section and EOF, which are copied as they are.
Anything else makes `filter_stream` raise `StreamFormatError`, and the caller keeps the stream
unfiltered (always valid).
"""

from __future__ import annotations

import bisect
import mmap
import re
import struct
from collections.abc import Collection
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


def filter_file(src: Path, dest: Path, block: str, keep: Collection[int]) -> DeltaStats:
    """`filter_stream` from file `src` into a new file `dest`. Blocking."""
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as data:
        parts, stats = filter_stream(memoryview(data), block.encode(), keep)
        with open(dest, "wb") as out:
            out.writelines(parts)
        for part in parts:  # slices of the map pin it until released
            if isinstance(part, memoryview):
                part.release()
    return stats


def filter_stream(
    data: memoryview, block: bytes, keep: Collection[int]
) -> tuple[list[memoryview | bytes], DeltaStats]:
    """The migration stream `data` without the RAM records of block `block` whose page index is
    not in `keep`; returned as pieces to write in order. Records of other blocks stay."""
    if bytes(data[:4]) != _MAGIC:
        raise StreamFormatError("not a QEMU migration stream")
    ram = _find_ram_start(data)
    out: list[memoryview | bytes] = [data[:ram]]
    pos, section_id = _section_header(data, ram)
    out.append(data[ram:pos])
    kept = 0
    wanted = sorted(keep)
    current: bytes | None = None  # the block the input's last record named
    last_out: bytes | None = None  # the block the output's last record named
    unpack = _BE64.unpack_from
    careful_until = 0  # records before this position go through the loop one by one
    while True:
        while True:  # the records of one section
            if current == block and pos >= careful_until:
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
                    careful_until = run.end()
            (word,) = unpack(data, pos)
            flags = word & _FLAGS_MASK
            if flags & ~_KNOWN:
                raise StreamFormatError(f"RAM record flags {flags:#x} at {pos}")
            head = pos + 8
            if flags & _MEM_SIZE:  # the block list: copied whole
                end = _skip_block_list(data, head, word & ~_FLAGS_MASK)
                out.append(data[pos:end])
                pos = end
                continue
            if flags & _EOS:
                out.append(data[pos:head])
                pos = head
                break
            if not flags & _CONTINUE:
                length = data[head]
                current = bytes(data[head + 1 : head + 1 + length])
                head += 1 + length
            if current is None:
                raise StreamFormatError(f"RAM record without a block at {pos}")
            if flags & _PAGE:
                end = head + PAGE
            elif flags & _ZERO:
                end = head + 1
            else:
                raise StreamFormatError(f"RAM record flags {flags:#x} at {pos}")
            offset = word & ~_FLAGS_MASK
            if current == block and offset // PAGE not in keep:
                pos = end
                continue
            if current == block:
                kept += 1
            # Records name their block unless it is the previous record's: dropping records
            # can change which block that is, so every kept record is written anew.
            if current == last_out:
                out.append(_BE64.pack(offset | (flags | _CONTINUE)))
            else:
                out.append(_BE64.pack(offset | (flags & ~_CONTINUE)))
                out.append(bytes([len(current)]) + current)
            out.append(data[head:end])
            last_out = current
            pos = end
        if data[pos] != _FOOTER or _BE32.unpack_from(data, pos + 1)[0] != section_id:
            raise StreamFormatError(f"no footer of the RAM section at {pos}")
        out.append(data[pos : pos + 5])
        pos += 5
        kind = data[pos]
        if kind not in (_SECTION_PART, _SECTION_END):
            break
        if _BE32.unpack_from(data, pos + 1)[0] != section_id:
            raise StreamFormatError(f"a section other than RAM's at {pos} before its end")
        out.append(data[pos : pos + 5])
        pos += 5
        # QEMU starts every section's records with their block name again.
        last_out = None
    out.append(data[pos:])
    size = sum(len(p) for p in out)
    return out, DeltaStats(kept, len(data), size)


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
    head = bytes(data[: 64 * 1024])
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
        length = data[pos]
        pos += 1 + length
        (used,) = _BE64.unpack_from(data, pos)
        seen += used
        pos += 16
    if seen != total:
        raise StreamFormatError("the RAM block list does not add up")
    return pos
