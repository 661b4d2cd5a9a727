"""cgroup v1 and v2 managers against fake hierarchies, and v1 for real where the host has it."""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

import pytest

from aenv.runtime.cgroups import CgroupError, CgroupLimits, CgroupV1, CgroupV2, detect

LIMITS = CgroupLimits(memory_bytes=512 << 20, pids=32, cpu_cores=1.5)


def fake_v1(root: Path) -> str:
    for controller in ("memory", "pids", "cpu"):
        (root / controller).mkdir(parents=True)
    return "4:memory:/outer/me\n8:pids:/\n1:cpu,cpuacct:/\n0::/\n"


def test_v1_nests_memory_under_our_own_group(tmp_path: Path) -> None:
    manager = CgroupV1("aenv", tmp_path, proc_cgroup=fake_v1(tmp_path))
    group = manager.create("vm1", LIMITS)
    mem = tmp_path / "memory" / "outer" / "me" / "aenv" / "vm1"
    assert (mem / "memory.limit_in_bytes").read_text() == str(512 << 20)
    assert (tmp_path / "pids" / "aenv" / "vm1" / "pids.max").read_text() == "32"
    assert (tmp_path / "cpu" / "aenv" / "vm1" / "cpu.cfs_quota_us").read_text() == "150000"
    group.add(1234)
    assert (mem / "cgroup.procs").read_text() == "1234"
    assert manager.names() == ["vm1"]


def test_v2_single_directory(tmp_path: Path) -> None:
    own = tmp_path / "system.slice" / "aenv.service"
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text("cpu memory pids hugetlb\n")

    # A real cgroupfs populates new directories; the fake needs the parent's controller list.
    parent = own / "aenv"
    parent.mkdir()
    (parent / "cgroup.controllers").write_text("cpu memory pids\n")
    manager = CgroupV2("aenv", tmp_path, proc_cgroup="0::/system.slice/aenv.service\n")
    group = manager.create("vm1", LIMITS)
    d = parent / "vm1"
    assert (d / "memory.max").read_text() == str(512 << 20)
    assert (d / "pids.max").read_text() == "32"
    assert (d / "cpu.max").read_text() == "150000 100000"
    group.add(99)
    assert (d / "cgroup.procs").read_text() == "99"


def test_real_hierarchy_limits_and_cleanup() -> None:
    if not Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory hierarchy on this host")
    manager = detect(f"aenv-test-{secrets.token_hex(3)}-{os.getpid()}")
    group = manager.create("probe", CgroupLimits(64 << 20, 8, 0.5))
    try:
        proc = subprocess.Popen(["sleep", "30"])
        try:
            group.add(proc.pid)
            cgroup = Path(f"/proc/{proc.pid}/cgroup").read_text()
            assert f"/{group.name}" in cgroup
        finally:
            proc.kill()
            proc.wait()
    finally:
        group.remove()
        manager.remove_parent()
    assert manager.names() == []


def test_sweep_removes_only_empty_stale_groups(tmp_path: Path) -> None:
    own = tmp_path / "svc"
    (own / "aenv-new").mkdir(parents=True)
    (own / "aenv-old" / "qemu-a").mkdir(parents=True)
    busy = own / "aenv-old" / "qemu-b"
    busy.mkdir()
    (busy / "cgroup.procs").write_text("42")  # a real busy group refuses rmdir like this
    (own / "unrelated" / "x").mkdir(parents=True)
    # Another live node's parent, its VMM's group made and not filled yet; and a dead one's.
    live = own / f"aenv-{os.getppid()}" / "qemu-c"
    live.mkdir(parents=True)
    dead = own / f"aenv-{_dead_pid()}" / "qemu-d"
    dead.mkdir(parents=True)
    manager = CgroupV2("aenv-new", tmp_path, proc_cgroup="0::/svc\n")
    removed = manager.sweep_stale("aenv-")
    assert sorted(removed) == sorted([own / "aenv-old" / "qemu-a", dead, dead.parent])
    assert busy.is_dir() and (own / "unrelated" / "x").is_dir() and (own / "aenv-new").is_dir()
    assert live.is_dir()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_remove_stale_by_name_in_every_hierarchy(tmp_path: Path) -> None:
    v1 = CgroupV1("aenv", tmp_path / "v1", proc_cgroup=fake_v1(tmp_path / "v1"))
    v1.create("vm1", LIMITS)
    v1.create("vm2", LIMITS)
    # The fake hierarchy is a plain directory tree: empty the groups as the kernel would.
    for path in (tmp_path / "v1").rglob("vm1/*"):
        path.unlink()
    removed = v1.remove_stale("vm1")
    assert sorted(p.parent.name for p in removed) == ["aenv", "aenv", "aenv"]
    assert v1.names() == ["vm2"]
    assert v1.remove_stale("vm1") == []  # gone already: nothing to do
    with pytest.raises(CgroupError, match="still busy"):
        v1.remove_stale("vm2")  # files stand in for member processes: refuses like a busy group
    with pytest.raises(CgroupError, match="not a cgroup name"):
        v1.remove_stale("../aenv")

    own = tmp_path / "v2" / "svc"
    (own / "aenv" / "vm3").mkdir(parents=True)
    v2 = CgroupV2("aenv", tmp_path / "v2", proc_cgroup="0::/svc\n")
    assert v2.remove_stale("vm3") == [own / "aenv" / "vm3"]
    assert v2.names() == []
