"""Guest console logs as the logs routes serve them: only the end of a big console file is
read, stamps stay fixed across requests, and a file capped meanwhile is read afresh."""

from __future__ import annotations

import os
from pathlib import Path

from aenv.api.logs import ConsoleLog
from aenv.orchestrator import consoles

LINE = "x" * 99  # 100 bytes with its newline


def _append(path: Path, first: int, count: int) -> None:
    with path.open("a") as f:
        f.writelines(f"{n:08d}{LINE[8:]}\n" for n in range(first, first + count))


async def test_only_the_end_of_a_big_console_file_is_read(tmp_path: Path) -> None:
    console = tmp_path / "console.vm.log"
    _append(console, 0, 200_000)  # 20 MB
    log = ConsoleLog(read_limit=64 * 1024)
    lines = await log.lines([console])
    numbers = [int(line.text[:8]) for line in lines]
    assert numbers[-1] == 199_999
    # Whole lines only, the last 64 KiB's worth, in order.
    assert numbers == list(range(numbers[0], 200_000))
    assert len(numbers) in (655, 656)
    assert all(len(line.text) == 99 for line in lines)


async def test_stamps_stay_fixed_and_new_lines_follow(tmp_path: Path) -> None:
    console = tmp_path / "console.vm.log"
    _append(console, 0, 10)
    log = ConsoleLog(read_limit=4096)
    first = await log.lines([console])
    os.utime(console, ns=(0, 0))  # the clock of later writes: stamps must not move back
    assert await log.lines([console]) == first
    _append(console, 10, 100)
    later = await log.lines([console])
    assert [line.text[:8] for line in later][-1] == "00000109"
    assert len(later) == 40  # the whole lines of the last 4 KiB
    stamps = {int(line.text[:8]): line.ms for line in later}
    assert all(stamps[n] == first[0].ms for n in stamps if n < 10)
    assert all(stamps[n] >= first[0].ms for n in stamps)


async def test_a_capped_console_is_read_afresh(tmp_path: Path) -> None:
    console = tmp_path / "console.vm.log"
    writer = os.open(console, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # as QEMU's append=on
    try:
        os.write(writer, b"".join(f"before {n}\n".encode() for n in range(1000)))
        log = ConsoleLog()
        assert len(await log.lines([console])) == 1000
        assert consoles.cap(console, limit=1024)
        assert not consoles.cap(console, limit=1024)  # under the limit now
        os.write(writer, b"after\n")
        # Appends land at the start of the emptied file, not past a hole.
        assert console.read_bytes() == b"after\n"
        old = consoles.old_path(console)
        lines = await log.lines([old, console])
    finally:
        os.close(writer)
    assert [line.text for line in lines][-2:] == ["before 999", "after"]
    assert len(lines) == 1001
