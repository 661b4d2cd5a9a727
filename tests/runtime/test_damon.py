"""The node's kdamond against DAMON's sysfs ABI as the kernel documents it (`damon_kernel`, a
double of the kernel's side in a temporary directory): every file the module writes, in order,
on a vaddr host and a paddr-only one; the refusals; the removal of a kdamond a killed server
left, and only that one. No root, no VM, nothing written outside the temporary directory."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from aenv.api.metrics import MemorySaversCollector
from aenv.orchestrator.memory_savers import MemorySavers
from aenv.runtime.damon import (
    ColdReclaim,
    ColdReclaimError,
    Operations,
    ReclaimSettings,
    VmmTarget,
    follow,
    memcg_of,
    probe,
    system_ram,
)
from aenv.runtime.ksm import Ksm
from tests.runtime.damon_kernel import KernelDouble

SETTINGS = ReclaimSettings(cold_after_s=120, bytes_per_s=32 << 20, ms_per_s=20)
IOMEM = """\
00000000-00000fff : Reserved
00001000-0009fbff : System RAM
00100000-bfffffff : System RAM
  01000000-01ffffff : Kernel code
100000000-63fffffff : System RAM
"""
SWAPS = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    """A /proc with a swap device, a boot id and the physical memory map."""
    d = tmp_path / "proc"
    (d / "sys/kernel/random").mkdir(parents=True)
    (d / "sys/kernel/random/boot_id").write_text("boot-1\n")
    (d / "swaps").write_text(SWAPS + "/dev/zram0\tpartition\t8388604\t0\t100\n")
    (d / "iomem").write_text(IOMEM)
    return d


@pytest.fixture
def zswap(tmp_path: Path) -> Path:
    path = tmp_path / "zswap_enabled"
    path.write_text("N\n")
    return path


def _kernel(tmp_path: Path, avail: str = "vaddr fvaddr paddr") -> KernelDouble:
    return KernelDouble(tmp_path / "admin", avail)


def _reclaim(kernel: KernelDouble, proc: Path, record: Path) -> ColdReclaim:
    return ColdReclaim(SETTINGS, record, kernel, proc)


def _following_one_vmm(kernel: KernelDouble, proc: Path, record: Path, zswap: Path) -> None:
    """A node's kdamond started and following VMM 101, then left as a kill -9 leaves it."""
    killed = _reclaim(kernel, proc, record)
    killed.start(zswap)
    kernel.live_pids |= {101}
    killed.update([VmmTarget(101, "/a/1")])


def _setup_writes(ops: str) -> list[tuple[str, str]]:
    c = "kdamonds/0/contexts/0"
    return [
        ("kdamonds/nr_kdamonds", "1"),
        ("kdamonds/0/contexts/nr_contexts", "1"),
        (f"{c}/schemes/nr_schemes", "1"),
        (f"{c}/operations", ops),
        (f"{c}/monitoring_attrs/intervals/sample_us", "200000"),
        (f"{c}/monitoring_attrs/intervals/aggr_us", "4000000"),
        (f"{c}/monitoring_attrs/intervals/update_us", "60000000"),
        (f"{c}/monitoring_attrs/nr_regions/min", "10"),
        (f"{c}/monitoring_attrs/nr_regions/max", "2000"),
    ]


def _scheme_writes() -> list[tuple[str, str]]:
    s = "kdamonds/0/contexts/0/schemes/0"
    return [
        (f"{s}/action", "pageout"),
        (f"{s}/access_pattern/sz/min", "0"),
        (f"{s}/access_pattern/sz/max", str(2**64 - 1)),
        (f"{s}/access_pattern/nr_accesses/min", "0"),
        (f"{s}/access_pattern/nr_accesses/max", "0"),
        (f"{s}/access_pattern/age/min", "30"),  # 120 s of 4 s aggregations
        (f"{s}/access_pattern/age/max", str(2**32 - 1)),
        (f"{s}/quotas/ms", "20"),
        (f"{s}/quotas/bytes", str(32 << 20)),
        (f"{s}/quotas/reset_interval_ms", "1000"),
        (f"{s}/quotas/weights/sz_permil", "0"),
        (f"{s}/quotas/weights/nr_accesses_permil", "0"),
        (f"{s}/quotas/weights/age_permil", "1000"),
        (f"{s}/watermarks/metric", "none"),
    ]


def test_vaddr_kdamond_follows_the_vmms_with_commit(
    tmp_path: Path, proc: Path, zswap: Path
) -> None:
    kernel = _kernel(tmp_path)
    record = tmp_path / "damon.json"
    reclaim = _reclaim(kernel, proc, record)
    assert reclaim.start(zswap) is Operations.VADDR
    assert kernel.writes == _setup_writes("vaddr") + _scheme_writes()
    assert not kernel.running()  # no VMM yet: off (a vaddr kdamond without targets stops)

    t = "kdamonds/0/contexts/0/targets"
    kernel.writes.clear()
    kernel.live_pids |= {101, 102, 103}
    reclaim.update([VmmTarget(102, "/a/2"), VmmTarget(101, "/a/1")])
    assert kernel.writes == [
        (f"{t}/nr_targets", "2"),
        (f"{t}/0/pid_target", "101"),
        (f"{t}/1/pid_target", "102"),
        ("kdamonds/0/state", "on"),
    ]
    pid = int((kernel.root / "kdamonds/0/pid").read_text())
    assert json.loads(record.read_text()) == {
        "boot_id": "boot-1",
        "kdamond": 0,
        "pid": pid,
        "operations": "vaddr",
    }

    kernel.writes.clear()
    reclaim.update([VmmTarget(101, "/a/1"), VmmTarget(103, "/a/3")])
    assert kernel.writes == [
        (f"{t}/nr_targets", "2"),
        (f"{t}/0/pid_target", "101"),
        (f"{t}/1/pid_target", "103"),
        ("kdamonds/0/state", "commit"),  # no restart: the same kdamond thread
    ]
    assert int((kernel.root / "kdamonds/0/pid").read_text()) == pid

    kernel.writes.clear()
    reclaim.update([])
    assert kernel.writes == [
        ("kdamonds/0/state", "update_schemes_stats"),
        ("kdamonds/0/state", "off"),
    ]

    kernel.writes.clear()
    reclaim.stop()
    assert kernel.writes == [("kdamonds/nr_kdamonds", "0")]
    assert not (kernel.root / "kdamonds/0").exists()
    assert not record.exists()


def test_a_vmm_gone_before_the_commit_is_refused_and_retried(
    tmp_path: Path, proc: Path, zswap: Path
) -> None:
    kernel = _kernel(tmp_path)
    reclaim = _reclaim(kernel, proc, tmp_path / "damon.json")
    reclaim.start(zswap)
    kernel.live_pids |= {101}
    reclaim.update([VmmTarget(101, "/a/1")])
    with pytest.raises(ColdReclaimError, match="state"):
        reclaim.update([VmmTarget(101, "/a/1"), VmmTarget(999, "/a/9")])  # 999 exited
    assert reclaim.targets == (VmmTarget(101, "/a/1"),)  # so the follower tries again
    kernel.live_pids |= {102}
    reclaim.update([VmmTarget(101, "/a/1"), VmmTarget(102, "/a/2")])
    assert kernel.writes[-1] == ("kdamonds/0/state", "commit")


def test_a_kdamond_that_stopped_by_itself_is_switched_on_again(
    tmp_path: Path, proc: Path, zswap: Path
) -> None:
    kernel = _kernel(tmp_path)
    reclaim = _reclaim(kernel, proc, tmp_path / "damon.json")
    reclaim.start(zswap)
    kernel.live_pids |= {101, 102}
    reclaim.update([VmmTarget(101, "/a/1")])
    kernel.stop_by_itself()  # its last VMM exited between two looks
    reclaim.update([VmmTarget(102, "/a/2")])
    assert kernel.writes[-1] == ("kdamonds/0/state", "on")
    assert kernel.running()


def test_paddr_only_host_filters_to_each_vmm_memcg(tmp_path: Path, proc: Path, zswap: Path) -> None:
    kernel = _kernel(tmp_path, avail="paddr")
    reclaim = _reclaim(kernel, proc, tmp_path / "damon.json")
    assert reclaim.start(zswap) is Operations.PADDR
    t = "kdamonds/0/contexts/0/targets"
    regions = [(0x1000, 0x9FC00), (0x100000, 0xC0000000), (0x100000000, 0x640000000)]
    target = [(f"{t}/nr_targets", "1"), (f"{t}/0/regions/nr_regions", "3")]
    for i, (start, end) in enumerate(regions):  # /proc/iomem's System RAM, end exclusive
        target += [(f"{t}/0/regions/{i}/start", str(start)), (f"{t}/0/regions/{i}/end", str(end))]
    assert kernel.writes == [*_setup_writes("paddr"), *target, *_scheme_writes()]

    kernel.writes.clear()
    f = "kdamonds/0/contexts/0/schemes/0/ops_filters"
    reclaim.update([VmmTarget(7, "/aenv-1/vm-b"), VmmTarget(5, "/aenv-1/vm-a")])
    assert kernel.writes == [
        (f"{f}/nr_filters", "4"),
        (f"{f}/0/type", "memcg"),
        (f"{f}/0/memcg_path", "/aenv-1/vm-a"),
        (f"{f}/0/matching", "Y"),
        (f"{f}/0/allow", "Y"),
        (f"{f}/1/type", "memcg"),
        (f"{f}/1/memcg_path", "/aenv-1/vm-b"),
        (f"{f}/1/matching", "Y"),
        (f"{f}/1/allow", "Y"),
        (f"{f}/2/type", "anon"),
        (f"{f}/2/matching", "Y"),
        (f"{f}/2/allow", "N"),
        (f"{f}/3/type", "anon"),
        (f"{f}/3/matching", "N"),
        (f"{f}/3/allow", "N"),
        ("kdamonds/0/state", "on"),
    ]


def test_stats_add_up_across_restarts(tmp_path: Path, proc: Path, zswap: Path) -> None:
    kernel = _kernel(tmp_path)
    reclaim = _reclaim(kernel, proc, tmp_path / "damon.json")
    reclaim.start(zswap)
    kernel.live_pids |= {101}
    reclaim.update([VmmTarget(101, "/a/1")])
    first = reclaim.stats()
    assert (first.running, first.tried_bytes, first.applied_bytes) == (True, 8192, 4096)
    reclaim.update([])  # off: one more refresh on the way (16384 / 8192)
    reclaim.update([VmmTarget(101, "/a/1")])  # on again: the kernel's stats start at 0
    again = reclaim.stats()
    assert (again.tried_bytes, again.applied_bytes, again.applied_regions) == (24576, 12288, 3)
    kernel.stop_by_itself()  # its VMMs exited: its figures go with it, as they were last read
    reclaim.update([VmmTarget(101, "/a/1")])
    assert reclaim.stats().applied_bytes == 12288 + 4096


def test_refusals_name_every_reason_and_write_nothing(tmp_path: Path, proc: Path) -> None:
    kernel = _kernel(tmp_path, avail="paddr")
    # Someone else's kdamond, running (as on this host), made before the node starts.
    kernel.put(kernel.root / "kdamonds/nr_kdamonds", "1")
    kernel.put(kernel.root / "kdamonds/0/contexts/nr_contexts", "1")
    kernel.put(kernel.root / "kdamonds/0/contexts/0/operations", "paddr")
    kernel.put(kernel.root / "kdamonds/0/state", "on")
    kernel.writes.clear()
    (proc / "swaps").write_text(SWAPS)
    zswap = tmp_path / "zswap_enabled"
    zswap.write_text("Y\n")
    reclaim = _reclaim(kernel, proc, tmp_path / "damon.json")
    with pytest.raises(ColdReclaimError) as caught:
        reclaim.start(zswap)
    message = str(caught.value)
    assert "cold reclaim needs swap: guest memory is anonymous or tmpfs" in message
    assert "zswap is on, and it needs a swap device behind it" in message
    assert "another DAMON user's kdamond 0 (pid " in message
    assert "no vaddr operations (CONFIG_DAMON_VADDR)" in message
    assert kernel.writes == []


def test_an_idle_kdamond_of_someone_else_is_not_rewritten(
    tmp_path: Path, proc: Path, zswap: Path
) -> None:
    kernel = _kernel(tmp_path)
    kernel.put(kernel.root / "kdamonds/nr_kdamonds", "1")
    kernel.writes.clear()
    with pytest.raises(ColdReclaimError, match="kdamond 0 is another DAMON user's"):
        _reclaim(kernel, proc, tmp_path / "damon.json").start(zswap)
    assert kernel.writes == []


def test_no_damon_sysfs_is_refused(tmp_path: Path, proc: Path, zswap: Path) -> None:
    facts = probe(tmp_path / "nothing", proc, zswap)
    assert facts.refusals() == ["this kernel has no DAMON sysfs interface (CONFIG_DAMON_SYSFS)"]


def test_a_killed_servers_kdamond_is_removed_at_the_next_start(
    tmp_path: Path, proc: Path, zswap: Path
) -> None:
    kernel = _kernel(tmp_path)
    record = tmp_path / "damon.json"
    _following_one_vmm(kernel, proc, record, zswap)
    kernel.writes.clear()
    _reclaim(kernel, proc, record).remove_stale()
    assert kernel.writes == [("kdamonds/0/state", "off"), ("kdamonds/nr_kdamonds", "0")]
    assert not record.exists()


def test_a_kdamond_that_is_not_the_recorded_one_is_left_alone(
    tmp_path: Path, proc: Path, zswap: Path
) -> None:
    kernel = _kernel(tmp_path)
    record = tmp_path / "damon.json"
    _following_one_vmm(kernel, proc, record, zswap)
    # Since then: the kdamond was switched off and on by someone (another thread, pid).
    kernel.put(kernel.root / "kdamonds/0/state", "off")
    kernel.put(kernel.root / "kdamonds/0/state", "on")
    kernel.writes.clear()
    _reclaim(kernel, proc, record).remove_stale()
    assert kernel.writes == []
    assert kernel.running()
    # A record of another boot names nothing that can still run.
    record.write_text(
        json.dumps({"boot_id": "boot-0", "kdamond": 0, "pid": 1, "operations": "vaddr"})
    )
    _reclaim(kernel, proc, record).remove_stale()
    assert kernel.writes == []
    assert not record.exists()


def test_memcg_and_system_ram_parsing(tmp_path: Path, proc: Path) -> None:
    (proc / "42").mkdir()
    (proc / "42/cgroup").write_text("4:memory:/aenv-9/vm-a\n1:cpu:/\n0::/\n")
    (proc / "43").mkdir()
    (proc / "43/cgroup").write_text("0::/system.slice/aenv/vm-b\n")
    assert memcg_of(42, proc) == "/aenv-9/vm-a"
    assert memcg_of(43, proc) == "/system.slice/aenv/vm-b"
    assert memcg_of(44, proc) is None
    assert system_ram(proc / "iomem")[0] == (0x1000, 0x9FC00)


async def test_the_follower_gives_the_kdamond_the_vmms_of_the_moment(
    tmp_path: Path, proc: Path, zswap: Path
) -> None:
    kernel = _kernel(tmp_path)
    reclaim = _reclaim(kernel, proc, tmp_path / "damon.json")
    reclaim.start(zswap)
    kernel.live_pids |= {101, 102}
    vmms = [VmmTarget(101, "/a/1")]
    task = asyncio.create_task(follow(reclaim, lambda: list(vmms), interval_s=0.01))
    try:
        await _until(lambda: reclaim.targets == (VmmTarget(101, "/a/1"),))
        assert kernel.running()
        vmms.append(VmmTarget(102, "/a/2"))
        await _until(lambda: len(reclaim.targets) == 2)
        assert kernel.writes[-1] == ("kdamonds/0/state", "commit")
        vmms.clear()
        await _until(lambda: not kernel.running())
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _until(check: Callable[[], bool]) -> None:
    for _ in range(500):  # bounds a broken follower; nothing is timed
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the follower did not get there")


def test_metrics_export_the_schemes_figures(tmp_path: Path, proc: Path, zswap: Path) -> None:
    kernel = _kernel(tmp_path)
    reclaim = _reclaim(kernel, proc, tmp_path / "damon.json")
    reclaim.start(zswap)
    kernel.live_pids |= {101}
    reclaim.update([VmmTarget(101, "/a/1")])
    registry = CollectorRegistry()
    registry.register(MemorySaversCollector(MemorySavers(Ksm(tmp_path / "no-ksm"), reclaim)))
    text = generate_latest(registry).decode()
    assert "aenv_cold_reclaim_running 1.0" in text
    assert "aenv_cold_reclaim_tried_bytes_total 8192.0" in text
    assert "aenv_cold_reclaim_applied_bytes_total 4096.0" in text
