"""The driver's full code path (spawn, configure, boot, pause, snapshot, restore, clones, stop,
cleanup) against `fc_peer.py` run as the `firecracker` binary: a real process serving the API on a
unix socket, checking every body against the swagger, writing and reading snapshot files the way
Firecracker does. No guest runs (KVM cannot run one here); `test_firecracker_live.py` boots real
guests where it can. Real cgroups and a real network namespace are used and removed."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from aenv.runtime import driver as d
from aenv.runtime.firecracker import FirecrackerDriver, create_driver
from aenv.runtime.firecracker.vm import FirecrackerVM
from tests.runtime.firecracker.fc_peer import FAIL_PATH, PAGE, RECORD_PATH
from tests.runtime.firecracker.fc_support import (
    MEM_MIB,
    alive,
    children,
    in_cgroup,
    page,
    pid_of,
    restore_target,
    snapshot_target,
)
from tests.runtime.firecracker.fc_swagger import Swagger


async def received(vm: d.VM) -> list[dict[str, Any]]:
    """What the peer process behind `vm` received, every body already checked by the swagger."""
    assert isinstance(vm, FirecrackerVM)
    answer = await vm.api._call("GET", RECORD_PATH)
    requests: list[dict[str, Any]] = answer.json()
    return requests


def bodies(requests: list[dict[str, Any]], method: str, path: str) -> list[Any]:
    return [r["body"] for r in requests if (r["method"], r["path"]) == (method, path)]


async def test_driver_satisfies_the_shared_interface(driver: FirecrackerDriver) -> None:
    assert isinstance(driver, d.Driver)
    assert isinstance(create_driver(), d.Driver)
    assert driver.name == "firecracker"


async def test_boot_configures_every_device_and_confines_the_process(
    driver: FirecrackerDriver, spec: d.VMSpec, netns: str
) -> None:
    vm = await driver.boot(spec)
    try:
        assert isinstance(vm, d.VM)
        assert vm.state is d.VMState.RUNNING
        pid = pid_of(vm)
        assert in_cgroup(pid, vm.id)
        net_ns = os.readlink(f"/proc/{pid}/ns/net")
        ns_inode = os.stat(f"/run/netns/{netns}").st_ino
        assert net_ns == f"net:[{ns_inode}]", "firecracker must run in the sandbox's netns"
        assert (await vm.api.describe_instance()).state == "Running"
        assert "test firecracker" in vm.console_log.read_text()
        stats = await vm.stats()
        assert stats.rss_bytes > 0 and stats.pss_bytes > 0 and stats.cpu_seconds >= 0
        assert stats.disk_bytes > 0  # the writable upper has one written block
        assert vm.cpu_time().seconds >= 0 and vm.cpu_time().started <= time.time()

        requests = await received(vm)
        order = [(r["method"], r["path"]) for r in requests if r["method"] != "GET"]
        assert order[:2] == [("PUT", "/logger"), ("PUT", "/metrics")]
        assert order[-1] == ("PUT", "/actions")
        assert bodies(requests, "PUT", "/machine-config") == [
            {"vcpu_count": 2, "mem_size_mib": MEM_MIB, "smt": False, "track_dirty_pages": True}
        ]
        boot = bodies(requests, "PUT", "/boot-source")[0]
        assert boot == {
            "kernel_image_path": "boot/vmlinux",
            "boot_args": "console=ttyS0 quiet",
            "initrd_path": "boot/initrd",
        }
        base, upper = (
            bodies(requests, "PUT", "/drives/base")[0],
            bodies(requests, "PUT", "/drives/upper")[0],
        )
        assert base == {
            "drive_id": "base",
            "is_root_device": False,
            "path_on_host": "drives/base",
            "is_read_only": True,
        }
        assert upper["path_on_host"] == "drives/upper" and upper["is_read_only"] is False
        assert upper["rate_limiter"] == driver.config.disk_rate_limiter.body()  # type: ignore[union-attr]
        nic = bodies(requests, "PUT", "/network-interfaces/eth0")[0]
        assert (nic["host_dev_name"], nic["guest_mac"]) == ("tap0", "02:fc:00:00:00:01")
        assert "tx_rate_limiter" in nic and "rx_rate_limiter" not in nic
        assert bodies(requests, "PUT", "/mmds/config") == [
            {"network_interfaces": ["eth0"], "version": "V2"}
        ]
        assert bodies(requests, "PUT", "/vsock") == [{"guest_cid": 3, "uds_path": "vsock.sock"}]
        assert isinstance(vm, FirecrackerVM) and vm.vsock_path == spec.workdir / "vsock.sock"
        assert bodies(requests, "PUT", "/balloon")[0]["free_page_reporting"] is True
        assert bodies(requests, "PUT", "/entropy") == [{}]
        assert bodies(requests, "PUT", "/actions") == [{"action_type": "InstanceStart"}]
    finally:
        await vm.stop()
    assert not alive(pid)
    assert not (spec.workdir / "api.sock").exists()
    assert not (spec.workdir / "drives").exists()
    assert sorted(p.name for p in spec.workdir.iterdir()) == []


async def test_pause_resume(driver: FirecrackerDriver, spec: d.VMSpec) -> None:
    vm = await driver.boot(spec)
    try:
        await vm.pause()
        assert vm.state is d.VMState.PAUSED
        assert (await vm.api.describe_instance()).state == "Paused"
        await vm.resume()
        assert vm.state is d.VMState.RUNNING
        assert (await vm.api.describe_instance()).state == "Running"
    finally:
        await vm.stop()
    await vm.stop()  # idempotent
    with pytest.raises(d.DriverError, match="stopped"):
        await vm.pause()


async def test_snapshot_restore_clone_chain(
    driver: FirecrackerDriver, spec: d.VMSpec, tmp_path: Path, netns: str
) -> None:
    source = await driver.boot(spec)
    try:
        snap = await source.snapshot(snapshot_target(tmp_path, "snap1"), keep_running=True)
        assert source.state is d.VMState.RUNNING
        assert (await source.api.describe_instance()).state == "Running"
    finally:
        await source.stop()

    # A booted VM's diff is the whole memory: written page 1, holes elsewhere (sparse).
    assert snap.memory_file is not None and snap.memory_file.parent == tmp_path / "mem"
    assert page(snap.memory_file, 1) == b"1" * PAGE
    assert snap.memory_file.stat().st_blocks * 512 < MEM_MIB << 20
    assert set(snap.disks) == {"upper"}
    sealed = snap.disks["upper"]
    assert sealed.read_bytes() == spec.disks[1].path.read_bytes()
    assert not os.access(sealed, os.W_OK) or os.geteuid() == 0
    assert sealed.stat().st_mode & 0o222 == 0
    assert d.Snapshot.load_manifest(snap.state_file.parent) == snap
    assert snap.compat.startswith("firecracker/1.17.0/")

    # Restore: private copy of the writable layer, shared read-only base, own tap, tracking on.
    clone = await driver.restore(snap, restore_target(tmp_path, "clone", netns))
    try:
        assert clone.state is d.VMState.RUNNING
        workdir = tmp_path / "clone"
        layer = workdir / "layers" / "upper.img"
        assert layer.read_bytes() == sealed.read_bytes()
        assert (workdir / "drives" / "upper").resolve() == layer
        assert (workdir / "drives" / "base").resolve() == spec.disks[0].path
        layer.write_bytes(b"the clone diverges")
        assert sealed.read_bytes() == spec.disks[1].path.read_bytes()

        snap2 = await clone.snapshot(snapshot_target(tmp_path, "snap2"), keep_running=False)
    finally:
        await clone.stop()
    assert clone.state is d.VMState.STOPPED
    # The clone's diff (page 2) was merged over the memory it was restored from (page 1).
    assert snap2.memory_file is not None
    assert page(snap2.memory_file, 1) == b"1" * PAGE
    assert page(snap2.memory_file, 2) == b"2" * PAGE
    assert not list((tmp_path / "mem").glob("*.diff"))
    # The clone's snapshot describes the clone: its workdir, its own layer, the source's MAC.
    assert snap2.spec.workdir == tmp_path / "clone"
    assert snap2.spec.disks[1].path == layer and snap2.spec.disks[0] == spec.disks[0]
    assert snap2.spec.net is not None and snap2.spec.net.mac == spec.net.mac
    # keep_running=False hands the clone's own layer over instead of copying it.
    assert snap2.disks["upper"].read_bytes() == b"the clone diverges"
    assert not layer.exists()
    assert sorted(p.name for p in (tmp_path / "clone").iterdir()) == []


async def test_restore_many_clones_and_cleans_up(
    driver: FirecrackerDriver, spec: d.VMSpec, tmp_path: Path, netns: str
) -> None:
    source = await driver.boot(spec)
    snap = await source.snapshot(snapshot_target(tmp_path, "snap"), keep_running=False)
    assert source.state is d.VMState.STOPPED

    targets = [restore_target(tmp_path, f"c{i}", netns) for i in range(3)]
    clones = await driver.restore_many(snap, targets)
    pids = [pid_of(c) for c in clones]
    try:
        assert len(set(pids)) == 3 and all(alive(p) for p in pids)
        assert len({c.id for c in clones}) == 3
        for clone in clones:
            requests = await received(clone)
            order = [(r["method"], r["path"]) for r in requests if r["method"] != "GET"]
            assert order == [
                ("PUT", "/logger"),
                ("PUT", "/metrics"),
                ("PUT", "/snapshot/load"),
                ("PATCH", "/drives/upper"),
                ("PATCH", "/network-interfaces/eth0"),
                ("PATCH", "/vm"),
            ]
            assert bodies(requests, "PUT", "/snapshot/load") == [
                {
                    "snapshot_path": "restore/vmstate.bin",
                    "mem_backend": {"backend_type": "File", "backend_path": "restore/memory.bin"},
                    "track_dirty_pages": True,
                    "resume_vm": False,
                    "network_overrides": [{"iface_id": "eth0", "host_dev_name": "tap0"}],
                }
            ]
            assert bodies(requests, "PATCH", "/vm") == [{"state": "Resumed"}]
    finally:
        await asyncio.gather(*(c.stop() for c in clones))
    assert not any(alive(p) for p in pids)
    for target in targets:
        assert list(target.workdir.iterdir()) == []


async def test_restore_many_is_all_or_nothing(
    driver: FirecrackerDriver, spec: d.VMSpec, tmp_path: Path, netns: str
) -> None:
    source = await driver.boot(spec)
    snap = await source.snapshot(snapshot_target(tmp_path, "snap"), keep_running=False)
    good = restore_target(tmp_path, "good", netns)
    bad = d.RestoreSpec(workdir=tmp_path / "missing", net=good.net)
    before = children()
    with pytest.raises(d.RestoreError):
        await driver.restore_many(snap, [good, bad])
    assert children() <= before
    assert list(good.workdir.iterdir()) == []


async def test_boot_errors_are_clear_and_leave_nothing(
    driver: FirecrackerDriver, spec: d.VMSpec, tmp_path: Path
) -> None:
    with pytest.raises(d.BootError, match="kernel not found"):
        await driver.boot(replace(spec, kernel=tmp_path / "nope"))
    with pytest.raises(d.BootError, match="drive id"):
        await driver.boot(replace(spec, disks=(d.Disk("../x", spec.disks[0].path),)))
    # Volumes need a shared-filesystem device, which Firecracker does not have.
    with pytest.raises(d.BootError, match="no shared-filesystem device"):
        await driver.boot(replace(spec, shares=(d.Share("aenv-vol0", tmp_path),)))

    crashing = tmp_path / "crashing-firecracker"
    crashing.write_text("#!/bin/sh\necho 'Error: KVM not supported' >&2\nexit 3\n")
    crashing.chmod(0o755)
    broken = FirecrackerDriver(replace(driver.config, binary=crashing), driver._cgroups)
    with pytest.raises(d.BootError, match=r"exited with 3.*KVM not supported"):
        await broken.boot(spec)
    assert list(spec.workdir.iterdir()) == []

    missing = FirecrackerDriver(replace(driver.config, binary=tmp_path / "no-fc"), driver._cgroups)
    with pytest.raises(d.BootError, match="binary not found"):
        await missing.boot(spec)


async def test_restore_errors(
    driver: FirecrackerDriver, spec: d.VMSpec, tmp_path: Path, netns: str
) -> None:
    source = await driver.boot(spec)
    snap = await source.snapshot(snapshot_target(tmp_path, "snap"), keep_running=False)

    with pytest.raises(d.IncompatibleSnapshotError, match="qemu"):
        await driver.restore(replace(snap, driver="qemu"), restore_target(tmp_path, "a", netns))

    other_cpu = replace(snap, compat=snap.compat.rsplit("/", 1)[0] + "/Some Other CPU")
    target = restore_target(tmp_path, "b", netns)
    with pytest.raises(d.IncompatibleSnapshotError, match="CPU"):
        await driver.restore(other_cpu, target)
    assert list(target.workdir.iterdir()) == []

    with pytest.raises(d.RestoreError, match="network attachment"):
        await driver.restore(snap, d.RestoreSpec(workdir=tmp_path / "a"))

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "vmstate.bin").write_bytes(b"\x00garbage")
    target = restore_target(tmp_path, "c", netns)
    with pytest.raises(d.RestoreError, match="400: Load snapshot error"):
        await driver.restore(replace(snap, state_file=corrupt / "vmstate.bin"), target)
    assert list(target.workdir.iterdir()) == []

    snap.memory_file.unlink()  # type: ignore[union-attr]
    with pytest.raises(d.RestoreError, match="snapshot file missing"):
        await driver.restore(snap, restore_target(tmp_path, "d", netns))


async def test_snapshot_failure_leaves_the_source_running(
    driver: FirecrackerDriver, spec: d.VMSpec, tmp_path: Path
) -> None:
    vm = await driver.boot(spec)
    try:
        target = d.SnapshotTarget(directory=tmp_path / "s", memory_dir=tmp_path / "nodir" / "x")
        (tmp_path / "nodir").write_text("a file where a directory should be")
        with pytest.raises(d.SnapshotError, match="nodir"):
            await vm.snapshot(target, keep_running=True)
        assert vm.state is d.VMState.RUNNING

        # Fail after Firecracker wrote the snapshot: the writable disk cannot be sealed.
        target = snapshot_target(tmp_path, "s2")
        upper = spec.disks[1].path
        content = upper.read_bytes()
        upper.unlink()
        with pytest.raises(d.SnapshotError, match=r"upper\.ext4"):
            await vm.snapshot(target, keep_running=True)
        upper.write_bytes(content)
        assert vm.state is d.VMState.RUNNING
        assert (await vm.api.describe_instance()).state == "Running"
        assert list(target.directory.iterdir()) == []
        assert list(target.memory_dir.iterdir()) == []
        # That failure lost the diff base; the next snapshot is a Full one and still works.
        snap = await vm.snapshot(snapshot_target(tmp_path, "ok"), keep_running=True)
        assert snap.memory_file is not None and page(snap.memory_file, 0) == b"F" * PAGE
    finally:
        await vm.stop()


async def test_snapshot_whose_vm_cannot_continue_is_discarded(
    driver: FirecrackerDriver, spec: d.VMSpec, tmp_path: Path
) -> None:
    vm = await driver.boot(spec)
    try:
        resume = {"method": "PATCH", "path": "/vm", "body": {"state": "Resumed"}}
        await vm.api._call("PUT", FAIL_PATH, {**resume, "status": 400, "message": "vCPU stuck"})
        target = snapshot_target(tmp_path, "s")
        with pytest.raises(d.SnapshotError, match="vCPU stuck"):
            await vm.snapshot(target, keep_running=True)
        assert list(target.directory.iterdir()) == []
        assert list(target.memory_dir.iterdir()) == []
        assert vm.state is d.VMState.PAUSED  # it could not be resumed either
    finally:
        await vm.stop()


async def test_mmds_and_balloon_extras(driver: FirecrackerDriver, spec: d.VMSpec) -> None:
    vm = await driver.boot(spec)
    try:
        await vm.put_metadata({"sandbox": {"id": vm.id}})
        assert await vm.api.get_mmds() == {"sandbox": {"id": vm.id}}
        await vm.set_balloon_target(2)
        stats = await vm.balloon_stats()
        assert stats.target_mib == 2
    finally:
        await vm.stop()


def test_every_recorded_body_is_swagger_valid(swagger: Swagger) -> None:
    """The peer refuses invalid bodies, so the tests above would fail on one; this documents the
    routes the driver uses and that each is a swagger operation with a body definition."""
    used = [
        ("PUT", "/logger"),
        ("PUT", "/metrics"),
        ("PUT", "/machine-config"),
        ("PUT", "/boot-source"),
        ("PUT", "/drives/upper"),
        ("PUT", "/network-interfaces/eth0"),
        ("PUT", "/mmds/config"),
        ("PUT", "/vsock"),
        ("PUT", "/balloon"),
        ("PUT", "/entropy"),
        ("PUT", "/actions"),
        ("PATCH", "/vm"),
        ("PUT", "/snapshot/create"),
        ("PUT", "/snapshot/load"),
        ("PATCH", "/drives/upper"),
        ("PATCH", "/network-interfaces/eth0"),
        ("PUT", "/mmds"),
        ("PATCH", "/balloon"),
    ]
    for method, path in used:
        found = swagger.operation(method, path)
        assert found is not None and found[0].body_definition, (method, path)


async def test_filesystem_only_snapshot_saves_the_disks_alone(
    driver: FirecrackerDriver, spec: d.VMSpec, tmp_path: Path, netns: str
) -> None:
    vm = await driver.boot(spec)
    try:
        snap = await vm.snapshot(
            snapshot_target(tmp_path, "fs"), keep_running=True, machine_state=False
        )
        assert vm.state is d.VMState.RUNNING
        calls = [(r["method"], r["path"]) for r in await received(vm)]
    finally:
        await vm.stop()
    assert ("PUT", "/snapshot/create") not in calls  # Firecracker's own snapshot was not taken
    assert ("PATCH", "/vm") in calls  # paused around the disk copy, then resumed
    assert not snap.machine_state and snap.memory_file is None
    assert snap.state_file.stat().st_size == 0
    assert snap.disks["upper"].read_bytes() == spec.disks[1].path.read_bytes()
    assert list((tmp_path / "mem").glob("*")) == []
    assert d.Snapshot.load_manifest(snap.state_file.parent) == snap
    with pytest.raises(d.RestoreError, match="filesystem-only"):
        await driver.restore(snap, restore_target(tmp_path, "r", netns))
