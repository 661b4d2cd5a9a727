"""Helpers shared by the Firecracker driver tests: targets for snapshots and restores, and checks
on the processes, cgroups and memory files the driver leaves behind."""

from __future__ import annotations

import os
from pathlib import Path

from aenv.runtime import driver as d
from aenv.runtime.firecracker.vm import FirecrackerVM
from tests.runtime.firecracker.fc_peer import PAGE

GUEST_MAC = "02:fc:00:00:00:01"
MEM_MIB = 4  # guest memory of the test VMs; the peer writes memory files of this size


def pid_of(vm: d.VM) -> int:
    assert isinstance(vm, FirecrackerVM) and vm.process is not None
    return vm.process.pid


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def in_cgroup(pid: int, name: str) -> bool:
    return any(
        line.endswith(f"/{name}") for line in Path(f"/proc/{pid}/cgroup").read_text().split()
    )


def children() -> set[int]:
    """Live child processes of this test process."""
    out = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                status = Path(entry.path, "status").read_text()
            except OSError:
                continue
            if f"PPid:\t{os.getpid()}\n" in status and "State:\tZ" not in status:
                out.add(int(entry.name))
    return out


def snapshot_target(tmp_path: Path, name: str) -> d.SnapshotTarget:
    return d.SnapshotTarget(directory=tmp_path / name, memory_dir=tmp_path / "mem")


def restore_target(tmp_path: Path, name: str, netns: str) -> d.RestoreSpec:
    workdir = tmp_path / name
    workdir.mkdir()
    return d.RestoreSpec(
        workdir=workdir, net=d.NetAttachment(netns=netns, tap="tap0", mac=GUEST_MAC)
    )


def page(path: Path, n: int) -> bytes:
    with path.open("rb") as f:
        f.seek(n * PAGE)
        return f.read(PAGE)
