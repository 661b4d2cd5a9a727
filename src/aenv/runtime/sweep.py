"""Startup sweep of the runtime layer: what a killed aenv process left behind.

A VMM started by one of our drivers keeps running (and holding memory) when its owner dies: it is
re-parented to init. Our VMMs are recognised by their command line, whichever driver started them:
QEMU by `-name aenv-<vm id>` (`QemuDriver`), Firecracker by `--id aenv-fc-<vm id>` next to
`--api-sock` (`FirecrackerDriver`; the jailer carries the same `--id` and execs Firecracker, and so
does `nsenter` when it puts Firecracker into a sandbox's network namespace). At startup, before
starting any VM, a node kills those that are its own (their command line names a file under its
data directory, or they run there: other nodes on the machine keep theirs), orphaned or not,
removes the VMM cgroups left under sibling parents named `aenv-*`, and lets each `Reclaimer` (the
Firecracker driver) remove what else its VMs leave: jails, their cgroups, and the driver's files
in a VM's working directory. Network
namespaces, disk layers and the catalog are swept by their own owners. The helper programs a
server runs (`qemu-img`, `cp`) need no sweep: they die with it (`aenv.subprocesses`).

While a node runs, its reconciler ends what no one owns: `reap_unowned`, VMMs of this process
that no VM object stands for; `reap_strays`, VMMs of this node (their command line names its data
directory) that another, dead, server process started and that appeared after the start-up
sweep (one the previous server was still starting, say).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import psutil

from aenv.runtime.cgroups import CgroupError, CgroupManager

VMM_NAME_PREFIX = "aenv-"
VmmKind = Literal["qemu", "firecracker"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Vmm:
    """One of our VMM processes, found by its command line."""

    pid: int
    kind: VmmKind
    name: str  # QEMU's `-name`, Firecracker's `--id` (also its cgroup and jail name)
    orphaned: bool  # its parent exited (it was re-parented to PID 1)
    cwd: Path | None  # where it runs: an unjailed Firecracker's workdir, or a jail's root
    stdout: Path | None  # the file its stdout goes to: a Firecracker's `<workdir>/console.log`
    cmdline: tuple[str, ...] = ()


class Reclaimer(Protocol):
    def reclaim_leftovers(
        self, prefix: str, killed: Sequence[Vmm], live: Collection[str]
    ) -> list[Path]:
        """Remove what VMMs named `prefix*` left (the `killed` ones and any that died before),
        except for the VMs named in `live` (still running under a live owner); returns what was
        removed. Blocking: called in a thread."""
        ...


@runtime_checkable
class Reaper(Protocol):
    def reap_unowned(self) -> list[str]:
        """Kill the driver's VMMs that no VM object stands for any more and remove cgroups
        nothing uses (see `reap_unowned`); returns the VMM names killed. Blocking."""
        ...


@dataclass(frozen=True)
class SweepReport:
    killed: tuple[int, ...]
    cgroups_removed: tuple[Path, ...]
    leftovers_removed: tuple[Path, ...] = ()


def vmm_identity(cmdline: Sequence[str], prefix: str) -> tuple[VmmKind, str] | None:
    """Which of our VMMs a command line starts (kind and name), or None for any other."""
    with contextlib.suppress(ValueError, IndexError):
        name = cmdline[cmdline.index("-name") + 1]
        if name.startswith(prefix):
            return "qemu", name
    if "--api-sock" in cmdline:
        with contextlib.suppress(ValueError, IndexError):
            name = cmdline[cmdline.index("--id") + 1]
            if name.startswith(prefix):
                return "firecracker", name
    return None


def our_vmms(prefix: str = VMM_NAME_PREFIX) -> list[Vmm]:
    """Every running VMM of ours, orphaned or not."""
    found = []
    for proc in psutil.process_iter(["ppid", "cmdline", "cwd"]):
        identity = vmm_identity(proc.info["cmdline"] or [], prefix)
        if identity is None:
            continue
        cwd = proc.info["cwd"]
        found.append(
            Vmm(
                pid=proc.pid,
                kind=identity[0],
                name=identity[1],
                orphaned=proc.info["ppid"] == 1,
                cwd=Path(cwd) if cwd else None,
                stdout=_stdout(proc.pid),
                cmdline=tuple(proc.info["cmdline"]),
            )
        )
    return found


def _stdout(pid: int) -> Path | None:
    try:
        target = os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return None
    return Path(target) if target.startswith("/") else None  # not e.g. "pipe:[1234]"


def orphaned_vmms(prefix: str = VMM_NAME_PREFIX) -> list[psutil.Process]:
    """Our VMM processes whose parent has exited (they were re-parented to PID 1)."""
    procs = []
    for vmm in our_vmms(prefix):
        if vmm.orphaned:
            with contextlib.suppress(psutil.NoSuchProcess):
                procs.append(psutil.Process(vmm.pid))
    return procs


def _sweep(
    cgroups: CgroupManager | None, prefix: str, reclaimers: Sequence[Reclaimer], home: Path
) -> SweepReport:
    found = our_vmms(prefix)
    roots = _roots(home)
    # Orphaned or not: a VMM of a killed server may still have a parent for a moment (a helper
    # that starts it and exits, a server that is still being torn down) or for good (a
    # subreaper); this process has started none yet.
    killed = _kill_unstarted([vmm for vmm in found if _under(vmm, roots)])
    live = {vmm.name for vmm in found} - {vmm.name for vmm in killed}
    removed = cgroups.sweep_stale(prefix) if cgroups is not None else []
    leftovers: list[Path] = []
    for reclaimer in reclaimers:
        leftovers += reclaimer.reclaim_leftovers(prefix, killed, live)
    if killed or removed or leftovers:
        log.warning(
            "startup sweep: killed %d VMMs a previous run left, removed %d cgroups and %d other"
            " leftovers",
            len(killed),
            len(removed),
            len(leftovers),
        )
    return SweepReport(tuple(v.pid for v in killed), tuple(removed), tuple(leftovers))


async def sweep(
    cgroups: CgroupManager | None,
    prefix: str = VMM_NAME_PREFIX,
    *,
    home: Path,
    reclaimers: Sequence[Reclaimer] = (),
) -> SweepReport:
    """The start-up sweep of the node whose data directory is `home`."""
    return await asyncio.to_thread(_sweep, cgroups, prefix, reclaimers, home)


def reap_unowned(
    owned: Callable[[], Collection[str]],
    cgroups: CgroupManager | None,
    cgroup_name: Callable[[str], str],
    prefix: str = VMM_NAME_PREFIX,
) -> list[str]:
    """Kill this process's own VMMs whose names `owned()` does not give (one that a failed or
    cancelled operation dropped without stopping it), and remove the cgroups, named by
    `cgroup_name`, of those and of any other VMM not owned that is gone. Other processes' VMMs,
    orphans included, are left alone: the startup sweep owns those. Returns the names killed.
    Blocking: run it in a thread, while the owner launches VMMs: `owned()` is asked again once
    the groups are listed, since a VMM launched after the first answer has a group then, empty
    until its process is placed in it."""
    me = os.getpid()
    killed: list[psutil.Process] = []
    names: list[str] = []
    running: set[str] = set()
    mine = owned()
    for vmm in our_vmms(prefix):
        running.add(vmm.name)
        if vmm.name in mine:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(vmm.pid)
            if proc.ppid() != me:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(vmm.pid, signal.SIGKILL)  # its own process group: helpers too
            killed.append(proc)
            names.append(vmm.name)
    psutil.wait_procs(killed, timeout=10)
    if cgroups is not None:
        groups = cgroups.names()
        wanted = {cgroup_name(name) for name in set(owned()) | (running - set(names))}
        for group in groups:
            if group not in wanted:
                with contextlib.suppress(CgroupError):
                    cgroups.remove_stale(group)
    if names:
        log.warning("reaped %d VMMs that nothing owned any more: %s", len(names), names)
    return names


def reap_strays(home: Path, prefix: str = VMM_NAME_PREFIX) -> list[Vmm]:
    """Kill the VMMs of the node whose data directory is `home` that this process did not start:
    a previous server of the node left them when it was killed (the startup sweep kills those
    running when it runs; the reconciler calls this for any that appear later). A VMM is the
    node's when its command line names a file under `home` or it runs there (a jail's root).
    Returns what was killed. Blocking: run it in a thread."""
    strays = _kill_unstarted(node_vmms(home, prefix))
    if strays:
        log.warning(
            "killed %d VMMs of this node that no server of it runs any more: %s",
            len(strays),
            [v.name for v in strays],
        )
    return strays


def _kill_unstarted(vmms: list[Vmm]) -> list[Vmm]:
    """Kill those of `vmms` that this process did not start (itself, or behind a wrapper that
    forks), and wait for them; returns those killed."""
    me = os.getpid()
    killed: list[Vmm] = []
    procs: list[psutil.Process] = []
    for vmm in vmms:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(vmm.pid)
            if any(parent.pid == me for parent in proc.parents()):
                continue
            proc.kill()
            procs.append(proc)
            killed.append(vmm)
    _gone, alive = psutil.wait_procs(procs, timeout=10)
    for proc in alive:
        log.warning("VMM %d survived SIGKILL", proc.pid)
    return killed


def node_vmms(home: Path, prefix: str = VMM_NAME_PREFIX) -> list[Vmm]:
    """The running VMMs of the node whose data directory is `home` (their command line names a
    file under it, or they run there), whichever server process started them."""
    roots = _roots(home)
    return [vmm for vmm in our_vmms(prefix) if _under(vmm, roots)]


def _roots(home: Path) -> set[str]:
    return {str(home).rstrip("/") + "/", str(home.resolve()).rstrip("/") + "/"}


def _under(vmm: Vmm, roots: Collection[str]) -> bool:
    places = [*vmm.cmdline, f"{vmm.cwd}/" if vmm.cwd else ""]
    return any(root in place for place in places for root in roots)
