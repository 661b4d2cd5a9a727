"""One cgroup per VMM process, behind a small interface with cgroup v1 and v2 implementations.

Groups are created under a parent named by the caller (e.g. `aenv`) and, for the memory controller,
nested under this process's own memory cgroup: a supervisor may already confine us there, and a
child outside it would escape that limit. v1 hosts (like the dev machine) get separate memory, pids
and cpu hierarchies; v2 hosts get one directory. On v2 the parent must be delegated to us (systemd
`Delegate=yes`) so controllers can be enabled for our children.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")
CPU_PERIOD_US = 100_000


class CgroupError(RuntimeError):
    """A cgroup could not be created, filled or removed."""


@dataclass(frozen=True)
class CgroupLimits:
    memory_bytes: int | None
    pids: int | None
    cpu_cores: float | None


class Cgroup(Protocol):
    @property
    def name(self) -> str: ...

    def add(self, pid: int) -> None: ...

    def remove(self) -> None:
        """Delete the group; its processes must have exited. Idempotent."""
        ...


class CgroupManager(Protocol):
    def create(self, name: str, limits: CgroupLimits) -> Cgroup: ...

    def names(self) -> list[str]:
        """Groups that exist under the parent (e.g. leftovers a startup sweep should remove)."""
        ...

    def remove_parent(self) -> None:
        """Remove the parent directories if they are empty (teardown)."""
        ...

    def sweep_stale(self, prefix: str) -> list[Path]:
        """Remove empty groups under sibling parents named `prefix*` (left by a killed process
        that used another parent name), and those parents once empty. Busy groups stay, and so
        does a parent whose name ends in `-<pid>` of a process that still runs: another live
        node's (on a machine running several, a VMM's group is empty between its creation and
        the VMM's start)."""
        ...

    def remove_stale(self, name: str) -> list[Path]:
        """Remove the group `name` under this parent (e.g. of a VMM a killed process left, under a
        parent name that this process uses too); returns the directories removed, none if there
        is no such group. Raises CgroupError if processes are still in it."""
        ...


def _own_path(controller: str, proc_cgroup: str) -> str:
    """This process's cgroup path in the hierarchy holding `controller` ('' for v2)."""
    for line in proc_cgroup.splitlines():
        _id, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return "/"


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise CgroupError(f"cannot write {value!r} to {path}: {exc}") from exc


def _rmdir_quietly(path: Path) -> None:
    """Remove a group that a failed creation made, still empty (best effort)."""
    with contextlib.suppress(OSError):
        path.rmdir()


def _rmdir(path: Path) -> None:
    # The kernel may take a moment to notice a just-reaped process has left the group.
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)
    raise CgroupError(f"cannot remove cgroup {path}: still busy")


@dataclass(frozen=True)
class _V1Group:
    name: str
    dirs: tuple[Path, ...]

    def add(self, pid: int) -> None:
        for d in self.dirs:
            _write(d / "cgroup.procs", str(pid))

    def remove(self) -> None:
        for d in self.dirs:
            _rmdir(d)


class CgroupV1:
    """memory, pids and cpu hierarchies mounted separately under `root`."""

    def __init__(self, parent: str, root: Path = CGROUP_ROOT, proc_cgroup: str | None = None):
        own = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
        self._bases = {
            c: root / c / _own_path(c, own).lstrip("/") / parent for c in ("memory", "pids", "cpu")
        }

    def create(self, name: str, limits: CgroupLimits) -> Cgroup:
        made: list[Path] = []
        with contextlib.ExitStack() as undo:
            for controller, base in self._bases.items():
                d = base / name
                d.mkdir(parents=True)
                undo.callback(_rmdir_quietly, d)
                made.append(d)
                if controller == "memory" and limits.memory_bytes is not None:
                    _write(d / "memory.limit_in_bytes", str(limits.memory_bytes))
                if controller == "pids" and limits.pids is not None:
                    _write(d / "pids.max", str(limits.pids))
                if controller == "cpu" and limits.cpu_cores is not None:
                    _write(d / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                    _write(d / "cpu.cfs_quota_us", str(int(limits.cpu_cores * CPU_PERIOD_US)))
            undo.pop_all()
        return _V1Group(name, tuple(made))

    def names(self) -> list[str]:
        found: set[str] = set()
        for base in self._bases.values():
            if base.is_dir():
                found.update(p.name for p in base.iterdir() if p.is_dir())
        return sorted(found)

    def remove_parent(self) -> None:
        for base in self._bases.values():
            with contextlib.suppress(OSError):
                base.rmdir()

    def sweep_stale(self, prefix: str) -> list[Path]:
        return _sweep(self._bases.values(), prefix)

    def remove_stale(self, name: str) -> list[Path]:
        return _remove_named(self._bases.values(), name)


class CgroupV2:
    """The unified hierarchy: one directory per VMM under `<own cgroup>/<parent>`."""

    def __init__(self, parent: str, root: Path = CGROUP_ROOT, proc_cgroup: str | None = None):
        own = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
        self._own = root / _own_path("", own).lstrip("/")
        self._base = self._own / parent

    def _enable(self, directory: Path) -> None:
        available = (directory / "cgroup.controllers").read_text().split()
        wanted = [c for c in ("memory", "pids", "cpu") if c in available]
        if wanted:
            _write(directory / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))

    def create(self, name: str, limits: CgroupLimits) -> Cgroup:
        if not self._base.is_dir():
            self._base.mkdir(parents=True, exist_ok=True)
            self._enable(self._own)
            self._enable(self._base)
        d = self._base / name
        with contextlib.ExitStack() as undo:
            d.mkdir()
            undo.callback(_rmdir_quietly, d)
            if limits.memory_bytes is not None:
                _write(d / "memory.max", str(limits.memory_bytes))
            if limits.pids is not None:
                _write(d / "pids.max", str(limits.pids))
            if limits.cpu_cores is not None:
                quota = int(limits.cpu_cores * CPU_PERIOD_US)
                _write(d / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            undo.pop_all()
        return _V2Group(name, d)

    def names(self) -> list[str]:
        if not self._base.is_dir():
            return []
        return sorted(p.name for p in self._base.iterdir() if p.is_dir())

    def remove_parent(self) -> None:
        with contextlib.suppress(OSError):
            self._base.rmdir()

    def sweep_stale(self, prefix: str) -> list[Path]:
        return _sweep([self._base], prefix)

    def remove_stale(self, name: str) -> list[Path]:
        return _remove_named([self._base], name)


@dataclass(frozen=True)
class _V2Group:
    name: str
    directory: Path

    def add(self, pid: int) -> None:
        _write(self.directory / "cgroup.procs", str(pid))

    def remove(self) -> None:
        _rmdir(self.directory)


def _sweep(own_parents: Iterable[Path], prefix: str) -> list[Path]:
    removed: list[Path] = []
    for own in own_parents:
        if not own.parent.is_dir():
            continue
        for parent in own.parent.iterdir():
            if not parent.is_dir() or not parent.name.startswith(prefix) or parent == own:
                continue
            if _owner_runs(parent.name):
                continue
            for group in [p for p in parent.iterdir() if p.is_dir()]:
                with contextlib.suppress(OSError):
                    group.rmdir()
                    removed.append(group)
            with contextlib.suppress(OSError):
                parent.rmdir()
                removed.append(parent)
    return removed


def _owner_runs(parent: str) -> bool:
    pid = parent.rpartition("-")[2]
    return pid.isdigit() and psutil.pid_exists(int(pid))


def _remove_named(bases: Iterable[Path], name: str) -> list[Path]:
    if not name or "/" in name or name in (".", ".."):
        raise CgroupError(f"not a cgroup name: {name!r}")
    removed: list[Path] = []
    busy: list[str] = []
    for d in (base / name for base in bases):
        if not d.is_dir():
            continue
        try:
            _rmdir(d)
        except CgroupError as exc:
            busy.append(str(exc))
            continue
        removed.append(d)
    if busy:
        raise CgroupError("; ".join(busy))
    return removed


def detect(parent: str, root: Path = CGROUP_ROOT) -> CgroupManager:
    """v1 when a v1 memory hierarchy is mounted (hybrid hosts keep their controllers there),
    else v2."""
    if (root / "memory" / "memory.limit_in_bytes").exists():
        return CgroupV1(parent, root)
    if (root / "cgroup.controllers").exists():
        return CgroupV2(parent, root)
    raise CgroupError(f"no usable cgroup hierarchy under {root}")
