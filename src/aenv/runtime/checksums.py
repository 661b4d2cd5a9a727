"""Checksums of the files of saved states: what `snapshot.json` records of each file and what a
restore compares, so a damaged or half-copied file is refused rather than restored.

A checksum is xxh3-128 (`xxhash`; about 30 times blake2b's speed here) over the file's content
in aligned blocks, each non-zero block hashed with its offset and all-zero blocks skipped. It
depends on the content alone, so a copy with other holes (a sparse copy, a repository pull) has
the same one, and holes cost no read: a guest memory file on tmpfs is mostly holes. It is
meant to catch damage, not forgery: anyone who can write a saved state can write its manifest.

Saved files are never written again, so a checksum is kept per inode, size and modification
time, and a file the node hashed already (its save, then every restore of it) is not read
again while none of those change. A write to it changes the modification time: the next
restore reads it again. Modification times are the kernel's coarse clock, a tick apart: a
checksum is kept only for a file last modified before the tick its hashing began, so a later
write cannot carry the same time (as git's "racily clean" index entries).
"""

from __future__ import annotations

import collections
import errno
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash

ALGORITHM = "xxh3-128"
BLOCK = 1 << 20
_ZEROS = bytes(BLOCK)
_CACHED = 4096  # files; far more than a node's saved states hold at once
# The clock the kernel stamps file times with (<linux/time.h>); Python names no constant for it.
_CLOCK_REALTIME_COARSE = 5


@dataclass(frozen=True)
class Checksum:
    size: int
    digest: str  # hex, of `ALGORITHM`


_cache: collections.OrderedDict[tuple[int, int, int, int], Checksum] = collections.OrderedDict()
_cache_lock = threading.Lock()


def of_file(path: Path) -> Checksum:
    """`path`'s checksum, read from it unless it is unchanged since the last time. Blocking;
    raises `OSError`."""
    started = time.clock_gettime_ns(_CLOCK_REALTIME_COARSE)
    with path.open("rb") as f:
        st = os.fstat(f.fileno())
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with _cache_lock:
            known = _cache.get(key)
            if known is not None:
                _cache.move_to_end(key)
                return known
        checksum = Checksum(st.st_size, _digest(f.fileno(), st.st_size))
    if st.st_mtime_ns >= started:  # written in this tick: a write after would look the same
        return checksum
    with _cache_lock:
        _cache[key] = checksum
        while len(_cache) > _CACHED:
            _cache.popitem(last=False)
    return checksum


def _digest(fd: int, size: int) -> str:
    total = xxhash.xxh3_128()
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    for start, end in _data_blocks(fd, size):
        for offset in range(start, end, BLOCK):
            length = os.preadv(fd, [view[: min(BLOCK, size - offset)]], offset)
            # bytes against bytes compare with memcmp; memoryviews, byte by byte.
            zero = buffer == _ZEROS if length == BLOCK else buffer[:length] == bytes(length)
            if not zero:
                total.update(offset.to_bytes(8, "little"))
                total.update(view[:length])
    total.update(size.to_bytes(8, "little"))
    return total.hexdigest()


def _data_blocks(fd: int, size: int) -> list[tuple[int, int]]:
    """The ranges of whole blocks that hold data (a range's end may be the file's end); the
    rest are holes. The whole file where the filesystem cannot tell."""
    ranges = []
    position = 0
    while position < size:
        try:
            data = os.lseek(fd, position, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole from here on
                break
            if e.errno == errno.EINVAL:  # no SEEK_DATA here
                return [(position, size)]
            raise
        hole = os.lseek(fd, data, os.SEEK_HOLE)
        start = data - data % BLOCK
        position = min(size, -(-hole // BLOCK) * BLOCK)
        ranges.append((start, position))
    return ranges
