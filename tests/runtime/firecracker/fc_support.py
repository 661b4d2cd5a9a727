"""Helpers shared by the Firecracker driver tests: targets for snapshots and restores, and checks
on the processes, cgroups and memory files the driver leaves behind, and a snapshot whose memory
is served from a repository (a `Uffd` restore's)."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from aenv.runtime import driver as d
from aenv.runtime.firecracker import FirecrackerDriver
from aenv.runtime.firecracker.vm import FirecrackerVM
from aenv.storage.repository import ChunkCache, PosixStore, Repository
from aenv.storage.repository.lazy import LazyFile
from tests.runtime.firecracker.fc_peer import PAGE, TOUCHED_PATH

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


@asynccontextmanager
async def memory_elsewhere(
    driver: FirecrackerDriver, spec: d.VMSpec, tmp_path: Path
) -> AsyncIterator[tuple[d.Snapshot, LazyFile, Repository, Path]]:
    """A snapshot taken through the driver whose memory file is in a repository and gone from
    here, and a `LazyFile` of it; yields the snapshot, the file, its repository and a copy of
    the memory file to compare with."""
    vm = await driver.boot(spec)
    snap = await vm.snapshot(snapshot_target(tmp_path, "s1"), keep_running=False)
    assert snap.memory_file is not None
    saved = tmp_path / "saved"
    saved.mkdir()
    shutil.copy(snap.memory_file, saved / "memory")
    snap.memory_file.unlink()  # this node lacks it
    store = PosixStore(tmp_path / "store")
    writer = Repository(store)
    try:
        manifest = await writer.put_tree(saved, name="memory")
    finally:
        writer.close()
    repo = Repository(store, ChunkCache(tmp_path / "cache", 1 << 30))
    lazy = LazyFile(repo, manifest, manifest.files[0], tmp_path / "lazy.mem", patience=1)
    try:
        yield snap, lazy, repo, saved / "memory"
    finally:
        lazy.close()
        repo.close()


async def touched(vm: FirecrackerVM, count: int = 2) -> dict[int, bytes]:
    """What the double's "vCPU" read of its guest memory, by offset, once it read `count` pages
    (or after 30 s, with what it read by then)."""
    seen: dict[int, bytes] = {}
    for _ in range(300):
        answer = (await vm.api._call("GET", TOUCHED_PATH)).json()
        seen = {int(offset): bytes.fromhex(data) for offset, data in answer.items()}
        if len(seen) >= count:
            break
        await asyncio.sleep(0.1)
    return seen
