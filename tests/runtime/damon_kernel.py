"""A double of the kernel's side of DAMON's sysfs ABI, in a temporary directory, as
Documentation/admin-guide/mm/damon/usage.rst and Documentation/ABI/testing/sysfs-kernel-mm-damon
describe it (Linux 6.18 layout, as on this host: `core_filters`, `ops_filters`, `filters`).

It is the `put` seam of `aenv.runtime.damon.DamonSysfs`: the module's own code reads and writes
real files under the directory; what the kernel does on a write, the double does after it:
- `nr_*` files remove every child directory and make that many fresh ones, with the kernel's
  files in them (and `nr_kdamonds` is refused with EBUSY while any kdamond runs);
- `state`: `on` (only when off; vaddr targets must be live pids) starts a kdamond with a new
  pid, `off` stops it, `commit` and `update_schemes_stats` need it running, anything else is
  EINVAL;
- `operations` takes only what `avail_operations` lists.
Every write is logged, so a test checks each file the module writes and their order.
"""

from __future__ import annotations

import errno
import itertools
import shutil
from collections.abc import Callable
from pathlib import Path

from aenv.runtime.damon import DamonSysfs

_PIDS = itertools.count(4000)
_STATS = ("nr_tried", "sz_tried", "nr_applied", "sz_applied", "sz_ops_filter_passed", "qt_exceeds")


def _files(directory: Path, values: dict[str, str]) -> None:
    for name, value in values.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{value}\n")


def _kdamond(d: Path) -> None:
    _files(d, {"state": "off", "pid": "-1", "refresh_ms": "0", "contexts/nr_contexts": "0"})


def _context(d: Path, avail: str) -> None:
    _files(
        d,
        {
            "avail_operations": avail,
            "operations": "vaddr",
            "addr_unit": "1",
            "monitoring_attrs/intervals/sample_us": "5000",
            "monitoring_attrs/intervals/aggr_us": "100000",
            "monitoring_attrs/intervals/update_us": "1000000",
            "monitoring_attrs/nr_regions/min": "10",
            "monitoring_attrs/nr_regions/max": "1000",
            "targets/nr_targets": "0",
            "schemes/nr_schemes": "0",
        },
    )


def _scheme(d: Path) -> None:
    values = {
        "action": "stat",
        "apply_interval_us": "0",
        "target_nid": "-1",
        "quotas/ms": "0",
        "quotas/bytes": "0",
        "quotas/reset_interval_ms": "0",
        "quotas/effective_bytes": "0",
        "quotas/goals/nr_goals": "0",
        "quotas/weights/sz_permil": "0",
        "quotas/weights/nr_accesses_permil": "0",
        "quotas/weights/age_permil": "0",
        "watermarks/metric": "none",
        "watermarks/interval_us": "0",
        "watermarks/high": "0",
        "watermarks/mid": "0",
        "watermarks/low": "0",
        "filters/nr_filters": "0",
        "core_filters/nr_filters": "0",
        "ops_filters/nr_filters": "0",
        "dests/nr_dests": "0",
        "tried_regions/total_bytes": "0",
    }
    for part, top in (("sz", 2**64 - 1), ("nr_accesses", 2**32 - 1), ("age", 2**32 - 1)):
        values[f"access_pattern/{part}/min"] = "0"
        values[f"access_pattern/{part}/max"] = str(top)
    values.update({f"stats/{name}": "0" for name in _STATS})
    _files(d, values)


def _filter(d: Path) -> None:
    _files(
        d,
        {
            "type": "anon",
            "matching": "N",
            "allow": "N",
            "memcg_path": "",
            "addr_start": "0",
            "addr_end": "0",
            "damon_target_idx": "0",
            "min": "0",
            "max": "0",
        },
    )


def _target(d: Path) -> None:
    _files(d, {"pid_target": "0", "regions/nr_regions": "0"})


def _region(d: Path) -> None:
    _files(d, {"start": "0", "end": "0"})


class KernelDouble(DamonSysfs):
    """`DamonSysfs` over a temporary `admin` directory that reacts as the kernel does."""

    def __init__(self, root: Path, avail: str = "vaddr fvaddr paddr") -> None:
        super().__init__(root)
        self.avail = avail
        self.writes: list[tuple[str, str]] = []
        self.live_pids: set[int] = set()  # processes that exist, for vaddr targets
        # What one `update_schemes_stats` adds to each running scheme's stats.
        self.progress = {"nr_tried": 2, "sz_tried": 8192, "nr_applied": 1, "sz_applied": 4096}
        _files(root, {"kdamonds/nr_kdamonds": "0"})

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.root))

    def put(self, path: Path, value: str) -> None:
        name = self.rel(path)
        if not path.is_file():
            raise OSError(errno.ENOENT, f"no such sysfs file: {name}")
        self.writes.append((name, value))
        react = self._reaction(path)
        if react is None:
            path.write_text(f"{value}\n")
            return
        react(path, value)

    def _reaction(self, path: Path) -> Callable[[Path, str], None] | None:
        makers: dict[str, Callable[[Path], None]] = {
            "kdamonds": _kdamond,
            "contexts": lambda d: _context(d, self.avail),
            "targets": _target,
            "regions": _region,
            "schemes": _scheme,
            "filters": _filter,
            "core_filters": _filter,
            "ops_filters": _filter,
        }
        if path.name.startswith("nr_") and path.parent.name in makers:
            return lambda p, v: self._children(p, v, makers[p.parent.name])
        if path.name == "state":
            return self._state
        if path.name == "operations":
            return self._operations
        return None

    def _children(self, path: Path, value: str, make: Callable[[Path], None]) -> None:
        if path.name == "nr_kdamonds" and self.running():
            raise OSError(errno.EBUSY, "a kdamond is running")
        count = int(value)
        for child in path.parent.iterdir():
            if child.is_dir():
                shutil.rmtree(child)
        for i in range(count):
            make(path.parent / str(i))
        path.write_text(f"{count}\n")

    def _operations(self, path: Path, value: str) -> None:
        if value not in self.avail.split():
            raise OSError(errno.EINVAL, f"{value} is not in avail_operations")
        path.write_text(f"{value}\n")

    def _state(self, path: Path, value: str) -> None:
        kdamond = path.parent
        on = (kdamond / "state").read_text().strip() == "on"
        if value == "on" and not on:
            self._check_targets(kdamond)
            _files(kdamond, {"state": "on", "pid": str(next(_PIDS))})
            for stats in kdamond.glob("contexts/0/schemes/*/stats"):
                _files(stats, dict.fromkeys(_STATS, "0"))  # a fresh context
        elif value == "off" and on:
            _files(kdamond, {"state": "off", "pid": "-1"})
        elif value == "commit" and on:
            self._check_targets(kdamond)
        elif value == "update_schemes_stats" and on:
            for stats in kdamond.glob("contexts/0/schemes/*/stats"):
                for name, step in self.progress.items():
                    now = int((stats / name).read_text())
                    (stats / name).write_text(f"{now + step}\n")
        else:
            raise OSError(errno.EINVAL, f"state {value!r} while {'on' if on else 'off'}")

    def _check_targets(self, kdamond: Path) -> None:
        context = kdamond / "contexts/0"
        if (context / "operations").read_text().strip() != "vaddr":
            return
        for pid_file in context.glob("targets/*/pid_target"):
            if int(pid_file.read_text()) not in self.live_pids:
                raise OSError(errno.EINVAL, f"no process {pid_file.read_text().strip()}")

    def running(self) -> bool:
        return any(p.read_text().strip() == "on" for p in self.root.glob("kdamonds/*/state"))

    def stop_by_itself(self, index: int = 0) -> None:
        """What a vaddr kdamond does once every target process has exited."""
        _files(self.root / f"kdamonds/{index}", {"state": "off", "pid": "-1"})
