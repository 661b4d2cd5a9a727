"""Cold guest memory reclaim with DAMON: one kdamond of the node pages out what its VMMs have not
touched for a while, to the swap the operator configured.

What is reclaimed, and where it goes. A VMM's memory is the guest's RAM (a private mapping of a
memory file on tmpfs: pages the guest wrote are anonymous, pages it only read are tmpfs pages
shared with other clones), and the emulator's own (anonymous: heap, TCG's translation cache).
Every kind needs swap to be paged out: tmpfs pages go to swap like anonymous ones. zswap is a
compressed cache in front of a swap device, so it needs one too. Without swap a `pageout`
finds nothing it may drop, and the node refuses `cold_reclaim_after` rather than run a scheme
that does nothing.

What the node runs (`ColdReclaim`), through the kernel's DAMON sysfs ABI
(Documentation/admin-guide/mm/damon/usage.rst):
- `vaddr` operations where the kernel has them: one target per VMM process (its pid), one
  `pageout` scheme for regions with no access for `cold_after_s`. A `pageout` of a virtual range
  is `MADV_PAGEOUT`, which skips pages other processes map too: the template pages that clones
  share stay, each VMM's own cold pages go. The kdamond stops by itself once every target has
  exited (no VMMs), and is switched on again with the next.
- `paddr` where only it exists: the physical memory ("System RAM" of /proc/iomem) as one
  target, and the scheme limited to the VMMs' memory with DAMOS filters. A memcg filter matches
  pages charged to that very cgroup, not to its descendants, and every VMM has a cgroup of its
  own (`runtime/cgroups.py`, the Firecracker jailer's), so the node writes one allow filter per
  VMM cgroup and then rejects everything else (`anon` and not `anon`). This needs the
  `ops_filters` directory (Linux 6.15: allow filters handled by the operations layer). `paddr`
  watches all of the host's memory to act on the VMMs' part, so `vaddr` is preferred.
- The targets (or filters) follow the VMMs as they start and stop: `update` rewrites them and
  writes `commit`, which the running kdamond takes without a restart.
- Bounds: a DAMOS quota of `bytes_per_s` and `ms_per_s` a second (the kdamond spends at most
  that much time paging out), coldest regions first (age weight), and no watermarks: cold pages
  are paged out before memory runs short, so the admission by real memory sees the room.

Which kdamond is the node's. The sysfs ABI has no owner or name for a kdamond, and writing
`nr_kdamonds` removes every kdamond directory, with its settings, and makes fresh ones; the
kernel refuses it (EBUSY) while any kdamond runs. So the node adds its kdamond only when there
is no kdamond directory at all: it is then kdamond 0 and alone, and while it runs nobody can
add or remove one. It records the kdamond's index, its thread's pid and the boot in a file of
its data directory (`Paths.damon`); a later start of the node that finds that record and that
kdamond (the same boot, and the same pid while it runs, or its operations when it is off) takes
it for its own, left by a killed server, switches it off and removes it. Any other kdamond
directory, running or not, is someone else's: the node refuses to start cold reclaim rather than
touch it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from aenv import atomic
from aenv.runtime.sweep import VMM_NAME_PREFIX, node_vmms

log = logging.getLogger(__name__)

SYSFS = Path("/sys/kernel/mm/damon/admin")
PROC = Path("/proc")
ZSWAP = Path("/sys/module/zswap/parameters/enabled")
U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1
_STATS = ("nr_tried", "sz_tried", "nr_applied", "sz_applied", "qt_exceeds")


class ColdReclaimError(RuntimeError):
    """Cold reclaim cannot run on this host; the message names every reason."""


class Operations(enum.StrEnum):
    VADDR = "vaddr"
    PADDR = "paddr"


@dataclass(frozen=True)
class ReclaimSettings:
    """What is cold and how much may be paged out. Monitoring: one access check a region every
    `sample_us`, judged every `aggr_us`; a region's age counts the aggregations it stayed cold.
    Regions: the kernel splits and merges them between `min_regions` and `max_regions` (its
    cost is one check a region a sample: at most 10,000 a second with the defaults)."""

    cold_after_s: int
    bytes_per_s: int
    ms_per_s: int
    sample_us: int = 200_000
    aggr_us: int = 4_000_000
    update_us: int = 60_000_000
    min_regions: int = 10
    max_regions: int = 2_000

    @property
    def min_age(self) -> int:
        """`cold_after_s` in aggregation intervals (the unit of a scheme's `age`)."""
        return max(1, math.ceil(self.cold_after_s * 1_000_000 / self.aggr_us))


@dataclass(frozen=True)
class Kdamond:
    index: int
    running: bool
    pid: int | None
    operations: str | None  # its context's, None without a context


@dataclass(frozen=True)
class HostFacts:
    """What the host offers, read without writing anything (`probe`)."""

    sysfs: bool
    kdamonds: tuple[Kdamond, ...]
    # `avail_operations` as an existing context reports it; None when there is no context to
    # ask (the node's own kdamond, once made, answers at `start`).
    operations: tuple[str, ...] | None
    # Whether a scheme directory has `ops_filters` (None: no scheme to look at).
    ops_filters: bool | None
    swap_bytes: int
    zswap: bool | None  # None: the kernel has no zswap

    def choice(self) -> tuple[Operations | None, str]:
        """The operations the node would use, and why (a sentence)."""
        if self.operations is None:
            return None, "the kernel's operations are known once the node's kdamond exists"
        return choose(self.operations, self.ops_filters)

    def refusals(self) -> list[str]:
        """Every reason cold reclaim cannot run here."""
        reasons: list[str] = []
        if not self.sysfs:
            reasons.append("this kernel has no DAMON sysfs interface (CONFIG_DAMON_SYSFS)")
        if self.swap_bytes == 0:
            zswap = "zswap is on" if self.zswap else "zswap is off"
            reasons.append(
                "cold reclaim needs swap: guest memory is anonymous or tmpfs and has nowhere "
                f"to go (no swap device in /proc/swaps; {zswap}, and it needs a swap device "
                "behind it)"
            )
        operations, why = self.choice()
        if operations is None and self.operations is not None:
            reasons.append(why)
        for kdamond in self.kdamonds:
            if kdamond.running:
                reasons.append(
                    f"another DAMON user's kdamond {kdamond.index} (pid {kdamond.pid}) is "
                    "running, and the kernel adds a kdamond only while none runs"
                )
            else:
                reasons.append(
                    f"kdamond {kdamond.index} is another DAMON user's: adding one rewrites "
                    "nr_kdamonds, which drops every kdamond's settings"
                )
        return reasons


def choose(available: Sequence[str], ops_filters: bool | None) -> tuple[Operations | None, str]:
    """vaddr when the kernel has it, else paddr with memcg allow filters (`ops_filters`; None:
    not known yet), else none; and why, in a sentence."""
    if Operations.VADDR in available:
        return Operations.VADDR, "vaddr: each VMM process is a target"
    missing = "no vaddr operations (CONFIG_DAMON_VADDR)"
    if Operations.PADDR in available and ops_filters is not False:
        return Operations.PADDR, f"{missing}: paddr, filtered to the VMMs' memory cgroups"
    return None, f"{missing}, and no paddr operations with memcg allow filters"


def probe(root: Path = SYSFS, proc: Path = PROC, zswap: Path = ZSWAP) -> HostFacts:
    """The host's DAMON, swap and zswap, read only. Blocking."""
    swap = _swap_bytes(proc / "swaps")
    zswap_on = zswap.read_text().strip() == "Y" if zswap.is_file() else None
    if not (root / "kdamonds" / "nr_kdamonds").is_file():
        return HostFacts(False, (), None, None, swap, zswap_on)
    sysfs = DamonSysfs(root)
    kdamonds = tuple(_kdamond(sysfs, i) for i in range(int(sysfs.read("kdamonds/nr_kdamonds"))))
    operations: tuple[str, ...] | None = None
    ops_filters: bool | None = None
    for context in sorted((root / "kdamonds").glob("*/contexts/*/avail_operations")):
        operations = tuple(context.read_text().split())
        scheme = context.parent / "schemes" / "0"
        if scheme.is_dir():
            ops_filters = (scheme / "ops_filters").is_dir()
        break
    return HostFacts(True, kdamonds, operations, ops_filters, swap, zswap_on)


def _swap_bytes(swaps: Path) -> int:
    """Total size of the active swap devices (/proc/swaps sizes are in KiB)."""
    lines = swaps.read_text().splitlines()[1:] if swaps.is_file() else []
    return sum(int(line.split()[2]) * 1024 for line in lines if line.strip())


def _kdamond(sysfs: DamonSysfs, index: int) -> Kdamond:
    base = f"kdamonds/{index}"
    running = sysfs.read(f"{base}/state") == "on"
    pid = int(sysfs.read(f"{base}/pid")) if running else None
    operations = None
    if (sysfs.root / base / "contexts/0/operations").is_file():
        operations = sysfs.read(f"{base}/contexts/0/operations")
    return Kdamond(index, running, pid, operations)


class DamonSysfs:
    """Reads and writes of DAMON's sysfs files, relative to its `admin` directory. Every write
    goes through `put`, one `write(2)` of the value as the kernel takes it."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def read(self, name: str) -> str:
        return (self.root / name).read_text().strip()

    def write(self, name: str, value: str | int) -> None:
        try:
            self.put(self.root / name, str(value))
        except OSError as exc:
            raise ColdReclaimError(f"cannot write {value!r} to DAMON's {name}: {exc}") from exc

    def put(self, path: Path, value: str) -> None:
        # Not `Path.write_text`: it opens with O_CREAT, and a sysfs file that is not there
        # must fail rather than be made (a plain directory in tests would take it).
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)


@dataclass(frozen=True)
class VmmTarget:
    """One VMM process and the memory cgroup its pages are charged to."""

    pid: int
    memcg: str


@dataclass(frozen=True)
class ReclaimStats:
    """The scheme's figures since the node started it (kept across the kdamond's restarts)."""

    running: bool
    tried_bytes: int  # cold regions the scheme was applied to
    applied_bytes: int  # what was paged out
    tried_regions: int
    applied_regions: int
    quota_exceeded: int  # times the quota stopped it


class ColdReclaim:
    """The node's kdamond (index 0, see the module doc). Blocking methods: call them in a
    thread."""

    INDEX = 0

    def __init__(
        self,
        settings: ReclaimSettings,
        record: Path,
        sysfs: DamonSysfs | None = None,
        proc: Path = PROC,
    ) -> None:
        self.settings = settings
        self.record = record
        self.sysfs = sysfs or DamonSysfs(SYSFS)
        self.proc = proc
        self.operations: Operations | None = None
        self._targets: tuple[VmmTarget, ...] = ()
        self._before = dict.fromkeys(_STATS, 0)  # totals of the kdamond's earlier runs
        self._last = dict.fromkeys(_STATS, 0)
        # One writer at a time: the follower's update in its thread, the metrics' refresh, and
        # the shutdown's stop (the update of a cancelled follower may still be running).
        self._lock = threading.RLock()

    @property
    def targets(self) -> tuple[VmmTarget, ...]:
        """The VMMs the kdamond was last given."""
        return self._targets

    @property
    def _base(self) -> str:
        return f"kdamonds/{self.INDEX}"

    @property
    def _context(self) -> str:
        return f"{self._base}/contexts/0"

    @property
    def _scheme(self) -> str:
        return f"{self._context}/schemes/0"

    def start(self, zswap: Path = ZSWAP) -> Operations:
        """Remove a kdamond a killed server of this node left, refuse (`ColdReclaimError`) if
        cold reclaim cannot run, then make the node's kdamond, switched off until `update`
        gives it VMMs. Returns the operations it uses."""
        self.remove_stale()
        facts = probe(self.sysfs.root, self.proc, zswap)
        reasons = facts.refusals()
        if reasons:
            raise ColdReclaimError(f"{'; '.join(reasons)} (operations: {facts.choice()[1]})")
        with contextlib.ExitStack() as undo:
            self.sysfs.write("kdamonds/nr_kdamonds", 1)
            undo.callback(self._remove_kdamond)
            self.operations = self._configure()
            undo.pop_all()
        self._save_record()
        return self.operations

    def _remove_kdamond(self) -> None:
        """Undo `start`'s kdamond (best effort: the caller is failing already)."""
        with contextlib.suppress(ColdReclaimError):
            self.sysfs.write("kdamonds/nr_kdamonds", 0)

    def _configure(self) -> Operations:
        s = self.settings
        self.sysfs.write(f"{self._base}/contexts/nr_contexts", 1)
        self.sysfs.write(f"{self._context}/schemes/nr_schemes", 1)
        available = self.sysfs.read(f"{self._context}/avail_operations").split()
        ops_filters = (self.sysfs.root / self._scheme / "ops_filters").is_dir()
        operations, why = choose(available, ops_filters)
        if operations is None:
            raise ColdReclaimError(why)
        ctx = self._context
        self.sysfs.write(f"{ctx}/operations", operations.value)
        attrs = f"{ctx}/monitoring_attrs"
        self.sysfs.write(f"{attrs}/intervals/sample_us", s.sample_us)
        self.sysfs.write(f"{attrs}/intervals/aggr_us", s.aggr_us)
        self.sysfs.write(f"{attrs}/intervals/update_us", s.update_us)
        self.sysfs.write(f"{attrs}/nr_regions/min", s.min_regions)
        self.sysfs.write(f"{attrs}/nr_regions/max", s.max_regions)
        if operations is Operations.PADDR:
            self._physical_target()
        self._write_scheme()
        return operations

    def _physical_target(self) -> None:
        ranges = system_ram(self.proc / "iomem")
        if not ranges:
            raise ColdReclaimError("no System RAM in /proc/iomem to monitor (paddr)")
        targets = f"{self._context}/targets"
        self.sysfs.write(f"{targets}/nr_targets", 1)
        self.sysfs.write(f"{targets}/0/regions/nr_regions", len(ranges))
        for i, (start, end) in enumerate(ranges):
            self.sysfs.write(f"{targets}/0/regions/{i}/start", start)
            self.sysfs.write(f"{targets}/0/regions/{i}/end", end)

    def _write_scheme(self) -> None:
        s, scheme = self.settings, self._scheme
        self.sysfs.write(f"{scheme}/action", "pageout")
        pattern = f"{scheme}/access_pattern"
        for name, low, high in (
            ("sz", 0, U64_MAX),
            ("nr_accesses", 0, 0),
            ("age", s.min_age, U32_MAX),
        ):
            self.sysfs.write(f"{pattern}/{name}/min", low)
            self.sysfs.write(f"{pattern}/{name}/max", high)
        quotas = f"{scheme}/quotas"
        self.sysfs.write(f"{quotas}/ms", s.ms_per_s)
        self.sysfs.write(f"{quotas}/bytes", s.bytes_per_s)
        self.sysfs.write(f"{quotas}/reset_interval_ms", 1000)
        for weight, value in (("sz_permil", 0), ("nr_accesses_permil", 0), ("age_permil", 1000)):
            self.sysfs.write(f"{quotas}/weights/{weight}", value)
        self.sysfs.write(f"{scheme}/watermarks/metric", "none")

    def update(self, targets: Sequence[VmmTarget]) -> None:
        """Reclaim from exactly `targets` from now on: rewrite the targets (vaddr) or the
        filters (paddr), then `commit` to the running kdamond, switch it on if it is off, or
        off when there is no VMM left. A VMM that exited meanwhile makes the kernel refuse the
        commit (`ColdReclaimError`): the caller tries again with the VMMs of the moment."""
        with self._lock:
            if self.operations is not None:
                self._update(tuple(sorted(set(targets), key=lambda t: t.pid)))

    def _update(self, targets: tuple[VmmTarget, ...]) -> None:
        running = self._running()
        if not targets:
            if running:
                self._switch_off()
            self._targets = targets
            return
        if self.operations is Operations.VADDR:
            self._write_pids(targets)
        else:
            self._write_filters(targets)
        if running:
            self.sysfs.write(f"{self._base}/state", "commit")
        else:
            # A kdamond that stopped by itself took its figures along: they are counted.
            self._before = {n: self._before[n] + self._last[n] for n in _STATS}
            self._last = dict.fromkeys(_STATS, 0)
            self.sysfs.write(f"{self._base}/state", "on")
            self._save_record()
        self._targets = targets

    def _write_pids(self, targets: Sequence[VmmTarget]) -> None:
        base = f"{self._context}/targets"
        self.sysfs.write(f"{base}/nr_targets", len(targets))
        for i, target in enumerate(targets):
            self.sysfs.write(f"{base}/{i}/pid_target", target.pid)

    def _write_filters(self, targets: Sequence[VmmTarget]) -> None:
        memcgs = sorted({t.memcg for t in targets})
        base = f"{self._scheme}/ops_filters"
        self.sysfs.write(f"{base}/nr_filters", len(memcgs) + 2)
        rows: list[tuple[str, str, str, str | None]] = [("memcg", "Y", "Y", m) for m in memcgs]
        # Everything else is rejected: anonymous or not, whatever the kernel's default for
        # memory no filter matched.
        rows += [("anon", "Y", "N", None), ("anon", "N", "N", None)]
        for i, (kind, matching, allow, memcg) in enumerate(rows):
            self.sysfs.write(f"{base}/{i}/type", kind)
            if memcg is not None:
                self.sysfs.write(f"{base}/{i}/memcg_path", memcg)
            self.sysfs.write(f"{base}/{i}/matching", matching)
            self.sysfs.write(f"{base}/{i}/allow", allow)

    def stats(self) -> ReclaimStats:
        """The scheme's figures (asks the running kdamond to refresh them first)."""
        with self._lock:
            running = self._running()
            if running:
                with contextlib.suppress(ColdReclaimError):  # it stopped just now: last figures
                    self.sysfs.write(f"{self._base}/state", "update_schemes_stats")
                    self._last = {
                        n: int(self.sysfs.read(f"{self._scheme}/stats/{n}")) for n in _STATS
                    }
            total = {n: self._before[n] + self._last[n] for n in _STATS}
        return ReclaimStats(
            running,
            total["sz_tried"],
            total["sz_applied"],
            total["nr_tried"],
            total["nr_applied"],
            total["qt_exceeds"],
        )

    def stop(self) -> None:
        """Switch the node's kdamond off and remove it (its directory, with `nr_kdamonds`), and
        the record. Idempotent."""
        with self._lock:
            if self.operations is None:
                return
            if self._running():
                self._switch_off()
            with contextlib.suppress(ColdReclaimError):  # another's kdamond runs: next start
                self.sysfs.write("kdamonds/nr_kdamonds", 0)
                self.record.unlink(missing_ok=True)
            self.operations = None

    def _switch_off(self) -> None:
        self.stats()  # its figures so far, before a restart sets them to zero
        self.sysfs.write(f"{self._base}/state", "off")
        self._before = {n: self._before[n] + self._last[n] for n in _STATS}
        self._last = dict.fromkeys(_STATS, 0)

    def _running(self) -> bool:
        with contextlib.suppress(OSError):
            return self.sysfs.read(f"{self._base}/state") == "on"
        return False

    def _save_record(self) -> None:
        pid = int(self.sysfs.read(f"{self._base}/pid")) if self._running() else None
        record = {
            "boot_id": _boot_id(self.proc),
            "kdamond": self.INDEX,
            "pid": pid,
            "operations": self.operations.value if self.operations else None,
        }
        atomic.write_text(self.record, json.dumps(record))

    def remove_stale(self) -> None:
        """Remove the kdamond a killed server of this node left, if its record names one that
        is still there (see the module doc); nothing else is touched. The node calls it at
        every start, cold reclaim configured or not. Blocking."""
        if not self.record.is_file():
            return
        facts = probe(self.sysfs.root, self.proc)
        try:
            record = json.loads(self.record.read_text())
        except ValueError:
            record = {}
        stale = [k for k in facts.kdamonds if _is_recorded(k, record, _boot_id(self.proc))]
        if stale and len(facts.kdamonds) > 1:
            # Removing it would remove the others' too: it stays recorded, and off.
            if stale[0].running:
                self.sysfs.write(f"kdamonds/{stale[0].index}/state", "off")
            return
        if stale:
            if stale[0].running:
                self.sysfs.write(f"kdamonds/{stale[0].index}/state", "off")
            self.sysfs.write("kdamonds/nr_kdamonds", 0)
            log.warning("removed the kdamond a previous server of this node left")
        self.record.unlink(missing_ok=True)


def _is_recorded(kdamond: Kdamond, record: dict[str, object], boot_id: str) -> bool:
    if record.get("boot_id") != boot_id or record.get("kdamond") != kdamond.index:
        return False
    if kdamond.running:
        return record.get("pid") == kdamond.pid
    return record.get("operations") == kdamond.operations


def _boot_id(proc: Path) -> str:
    return (proc / "sys/kernel/random/boot_id").read_text().strip()


def system_ram(iomem: Path) -> list[tuple[int, int]]:
    """The host's top-level "System RAM" ranges of /proc/iomem, as [start, end) pairs."""
    ranges = []
    for line in iomem.read_text().splitlines():
        if line.startswith(" ") or not line.rstrip().endswith(": System RAM"):
            continue
        start, end = line.split(" : ", 1)[0].split("-")
        ranges.append((int(start, 16), int(end, 16) + 1))
    return ranges


def memcg_of(pid: int, proc: Path = PROC) -> str | None:
    """The memory cgroup of process `pid`, as DAMON's `memcg_path` names it (its path from the
    memory hierarchy's mount point); None when the process is gone."""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    unified = None
    for line in text.splitlines():
        _id, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path
        if _id == "0" and not controllers:
            unified = path
    return unified


def node_targets(home: Path, proc: Path = PROC, prefix: str = VMM_NAME_PREFIX) -> list[VmmTarget]:
    """The VMM processes of the node whose data directory is `home`, with their memory
    cgroups. Blocking."""
    found = []
    for vmm in node_vmms(home, prefix):
        memcg = memcg_of(vmm.pid, proc)
        if memcg is not None:
            found.append(VmmTarget(vmm.pid, memcg))
    return found


async def follow(
    reclaim: ColdReclaim,
    vmms: Callable[[], list[VmmTarget]],
    interval_s: float = 10.0,
) -> None:
    """Keep `reclaim`'s targets on the node's VMMs, looking every `interval_s` seconds, until
    cancelled. A VMM is cold only after `cold_after_s`, so one found a few seconds late loses
    nothing."""
    while True:
        targets = await asyncio.to_thread(vmms)
        if set(targets) != set(reclaim.targets):
            try:
                await asyncio.to_thread(reclaim.update, targets)
            except ColdReclaimError as exc:
                log.warning("cold reclaim: targets not updated (tried again soon): %s", exc)
        await asyncio.sleep(interval_s)
