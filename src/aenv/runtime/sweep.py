"""Startup sweep of the runtime layer: what a killed aenv process left behind.

A QEMU started by `QemuDriver` carries `-name aenv-<vm id>`; when its owner dies it is re-parented
to init and keeps running (and holding memory) forever. At startup, before starting any VM, a
node kills such orphans and removes the VMM cgroups they leave empty. Network namespaces, disk
layers and the catalog are swept by their own owners.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path

import psutil

from aenv.runtime.cgroups import CgroupManager

VMM_NAME_PREFIX = "aenv-"


@dataclass(frozen=True)
class SweepReport:
    killed: tuple[int, ...]
    cgroups_removed: tuple[Path, ...]


def orphaned_vmms(prefix: str = VMM_NAME_PREFIX) -> list[psutil.Process]:
    """Our VMM processes whose parent has exited (they were re-parented to PID 1)."""
    found = []
    for proc in psutil.process_iter(["ppid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        with contextlib.suppress(ValueError, IndexError):
            name = cmdline[cmdline.index("-name") + 1]
            if name.startswith(prefix) and proc.info["ppid"] == 1:
                found.append(proc)
    return found


def _sweep(cgroups: CgroupManager | None, prefix: str) -> SweepReport:
    victims = orphaned_vmms(prefix)
    for proc in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(victims, timeout=10)
    removed = cgroups.sweep_stale(prefix) if cgroups is not None else []
    return SweepReport(tuple(p.pid for p in victims), tuple(removed))


async def sweep(cgroups: CgroupManager | None, prefix: str = VMM_NAME_PREFIX) -> SweepReport:
    return await asyncio.to_thread(_sweep, cgroups, prefix)
