"""The driver's side of saved states against `fc_peer.py`: booting a saved state's disks without its
memory, exporting a saved state and reading it back, the kernel form it boots, and its refusal of
qcow2 images, which Firecracker cannot read (it would hand them to the guest as garbage)."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from aenv.runtime import driver as d
from aenv.runtime.firecracker import FirecrackerDriver
from aenv.runtime.firecracker.vm import FirecrackerVM
from tests.runtime.firecracker.fc_support import restore_target, snapshot_target
from tests.runtime.firecracker.test_firecracker_driver import bodies, received


def qcow2_image(path: Path) -> Path:
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(path), "16M"], check=True)
    return path


def test_boots_the_uncompressed_kernel(driver: FirecrackerDriver, tmp_path: Path) -> None:
    kernels = d.KernelImages(bzimage=tmp_path / "bzImage", vmlinux=tmp_path / "vmlinux")
    assert driver.kernel_image(kernels) == tmp_path / "vmlinux"


async def test_saved_disks_boot_on_a_private_copy(
    driver: FirecrackerDriver, spec: d.VMSpec, tmp_path: Path, netns: str
) -> None:
    source = await driver.boot(spec)
    saved = await source.snapshot(
        snapshot_target(tmp_path, "fs"), keep_running=False, machine_state=False
    )
    target = restore_target(tmp_path, "cold", netns)
    vm = await driver.boot_saved(replace(saved, spec=replace(saved.spec, vcpus=1)), target)
    try:
        assert isinstance(vm, FirecrackerVM)
        layer = target.workdir / "layers" / "upper.img"
        assert layer.read_bytes() == saved.disks["upper"].read_bytes()
        assert layer.stat().st_ino != saved.disks["upper"].stat().st_ino  # a copy, not the seal
        requests = await received(vm)
        calls = [(r["method"], r["path"]) for r in requests]
        assert ("PUT", "/snapshot/load") not in calls  # booted, not restored
        assert bodies(requests, "PUT", "/machine-config")[0]["vcpu_count"] == 1
        assert bodies(requests, "PUT", "/network-interfaces/eth0")[0]["guest_mac"] == (
            spec.net.mac if spec.net else None
        )
        assert (target.workdir / "drives" / "upper").resolve() == layer
    finally:
        await vm.stop()
    assert not layer.exists()  # the private copy went with the VM
    assert saved.disks["upper"].is_file()

    with pytest.raises(d.IncompatibleSnapshotError):
        await driver.boot_saved(replace(saved, driver="qemu"), target)


async def test_export_links_every_file_and_loads_back(
    driver: FirecrackerDriver, spec: d.VMSpec, tmp_path: Path
) -> None:
    source = await driver.boot(spec)
    snap = await source.snapshot(snapshot_target(tmp_path, "snap"), keep_running=False)
    dest = tmp_path / "export"
    dest.mkdir()
    exported = await driver.export(snap, dest, move=False)
    assert exported.disks["upper"] == dest / "disk-upper.img"
    assert exported.disks["upper"].stat().st_ino == snap.disks["upper"].stat().st_ino
    assert exported.memory_file is not None and snap.memory_file is not None
    assert exported.memory_file.read_bytes() == snap.memory_file.read_bytes()
    assert snap.state_file.is_file()  # shared, the source stays whole
    assert await driver.load_saved(dest) == exported

    moved_to = tmp_path / "moved"
    moved_to.mkdir()
    moved = await driver.export(exported, moved_to, move=True)
    assert not exported.state_file.exists() and moved.state_file.is_file()
    assert await driver.load_saved(moved_to) == moved

    moved.memory_file.unlink()  # type: ignore[union-attr]
    with pytest.raises(d.RestoreError, match="lacks"):
        await driver.load_saved(moved_to)


async def test_qcow2_images_are_refused(
    driver: FirecrackerDriver, spec: d.VMSpec, tmp_path: Path, netns: str
) -> None:
    source = await driver.boot(spec)
    snap = await source.snapshot(snapshot_target(tmp_path, "snap"), keep_running=False)
    as_qcow2 = replace(snap, disks={"upper": qcow2_image(tmp_path / "upper.qcow2")})
    target = restore_target(tmp_path, "r", netns)
    with pytest.raises(d.RestoreError, match="qcow2"):
        await driver.restore(as_qcow2, target)
    with pytest.raises(d.BootError, match="qcow2"):
        await driver.boot_saved(replace(as_qcow2, machine_state=False), target)
    assert list(target.workdir.iterdir()) == []
    with pytest.raises(d.BootError, match="qcow2"):
        await driver.boot(replace(spec, disks=(d.Disk("upper", tmp_path / "upper.qcow2"),)))
    dest = tmp_path / "export"
    dest.mkdir()
    await driver.export(as_qcow2, dest, move=False)
    with pytest.raises(d.RestoreError, match="qcow2"):
        await driver.load_saved(dest)
