"""Helper programs the node runs (disk tools, copies, guest build steps) die with the process
that started them.

A `kill -9` of a server would otherwise leave its `qemu-img convert` or `cp` running: re-parented
to init, still writing into a sandbox's files that the next start reclaims, and named by nothing
the start-up sweep looks for (VMMs are; see `aenv.runtime.sweep`). `setpriv --pdeathsig KILL`
sets the parent-death signal and execs the tool, which keeps it (it is cleared only by the exec
of a set-user-ID program). The kernel sends it when the thread that started the tool exits: the
tools are started from an event loop's thread and awaited there, so that thread outlives them
unless the process dies. VMMs are not started this way: a graceful stop pauses them, and the
start-up sweep owns those a killed server leaves.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Sequence
from pathlib import Path


class MissingProgram(RuntimeError):
    """A program the node needs is not installed."""


@functools.cache
def _setpriv() -> str:
    found = shutil.which("setpriv")
    if found is None:
        raise MissingProgram("setpriv not found: install util-linux")
    return found


def tied(argv: Sequence[str | Path]) -> list[str]:
    """`argv` as a command that is killed when the calling process dies."""
    return [_setpriv(), "--pdeathsig", "KILL", "--", *map(str, argv)]
