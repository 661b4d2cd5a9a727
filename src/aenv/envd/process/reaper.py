"""Reaping orphans when envd runs as PID 1.

A background child whose parent exits (`server &` in a command) is re-parented to PID 1. In a
guest with its own init that init reaps it; when envd itself is PID 1 (a container, a bare
chroot, the test harness' PID namespace) nobody would, and zombies would pile up. Then envd
reaps every exited child that is not one of its own processes (those are waited for by their
`ProcessHandle`, which needs their exit status).
"""

from __future__ import annotations

import asyncio
import contextlib
import os

# PIDs of processes envd spawned itself and has not waited for yet (registered synchronously
# with the spawn, so the reaper, a loop callback, never sees one of them unregistered).
OWN_CHILDREN: set[int] = set()


def _exited_children() -> list[int]:
    """PIDs of zombie processes whose parent is this process."""
    me = os.getpid()
    zombies = []
    with contextlib.suppress(OSError), os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            # pid (comm) state ppid ...; comm may contain spaces and parentheses.
            fields = stat[stat.rfind(b")") + 2 :].split()
            if len(fields) >= 2 and fields[0] == b"Z" and int(fields[1]) == me:
                zombies.append(int(entry.name))
    return zombies


def reap_orphans() -> None:
    for pid in _exited_children():
        if pid not in OWN_CHILDREN:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


# How often orphans are looked for (uvloop keeps SIGCHLD for itself, so this polls).
REAP_INTERVAL_SECONDS = 1.0


def install_if_init(loop: asyncio.AbstractEventLoop) -> bool:
    """Reap orphans periodically (for envd's lifetime) if envd is PID 1; returns whether."""
    if os.getpid() != 1:
        return False

    def tick() -> None:
        reap_orphans()
        loop.call_later(REAP_INTERVAL_SECONDS, tick)

    loop.call_soon(tick)
    return True
