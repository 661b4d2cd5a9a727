"""The guest's PID 1 in the real root (`aenv-init`, source in `pid1.c`): compiled here, static
with musl, so it runs in any template image whatever its libc (or none).

It replaces tini, which waits for signals with a 1 s timeout and so wakes every idle guest once
a second; `aenv-init` waits with none (see the source). musl-gcc comes from Debian's
`musl-tools` (scripts/install-system-deps.sh).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from aenv.guest.proc import run

SOURCE = Path(__file__).with_name("pid1.c")
COMPILER = "musl-gcc"
NAME = "aenv-init"


async def compiler_version() -> str:
    return (await run(COMPILER, "-dumpfullversion")).strip()


def source_hash() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()


async def build_pid1(out_dir: Path) -> Path:
    """Compile `aenv-init` into `out_dir`; raises `BuildError` when the compiler fails."""
    binary = out_dir / NAME
    await run(COMPILER, "-static", "-Os", "-s", "-Wall", "-Wextra", "-Werror", "-o", binary, SOURCE)
    return binary
