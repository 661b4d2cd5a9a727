"""Bad input gives a clear DriverError and leaks nothing (checked by the `no_leaks` fixture)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from aenv.runtime.driver import (
    BootError,
    IncompatibleSnapshotError,
    RestoreError,
    RestoreSpec,
    Share,
    Snapshot,
    VMSpec,
    share_tag,
)
from aenv.runtime.qemu import Platform, QemuDriver
from tests.runtime.qemu_vm.conftest import Places, Template
from tests.runtime.qemu_vm.netns import NetnsPool

pytestmark = pytest.mark.slow


def copy_snapshot(snap: Snapshot, places: Places) -> Snapshot:
    """A private copy of the snapshot's state file, so a test can damage it."""
    target = places.snapshot_target()
    state = target.directory / "state"
    state.write_bytes(snap.state_file.read_bytes())
    return dataclasses.replace(snap, state_file=state)


def leftover_files(workdir: Path) -> list[Path]:
    return [p for p in workdir.iterdir() if not p.name.endswith(".log")]


async def test_missing_kernel(driver: QemuDriver, places: Places, no_leaks: None) -> None:
    workdir = places.vm_dir()
    spec = VMSpec(vcpus=1, memory_mib=64, kernel=workdir / "nope", cmdline="", workdir=workdir)
    with pytest.raises(BootError, match="missing file"):
        await driver.boot(spec)
    assert leftover_files(workdir) == []


async def test_kernel_that_is_not_a_kernel(
    driver: QemuDriver, places: Places, no_leaks: None
) -> None:
    workdir = places.vm_dir()
    bogus = workdir / "bogus-kernel"
    bogus.write_bytes(b"not a kernel" * 100)
    spec = VMSpec(
        vcpus=1, memory_mib=64, kernel=bogus, cmdline="", workdir=workdir, memory_dir=places.shm
    )
    with pytest.raises(BootError, match="QEMU"):
        await driver.boot(spec)
    assert leftover_files(workdir) == [bogus]
    assert not list(places.shm.glob("*.mem"))


async def test_corrupt_snapshot(
    driver: QemuDriver, template: Template, places: Places, nets: NetnsPool, no_leaks: None
) -> None:
    snap = copy_snapshot(template.snapshot, places)
    data = bytearray(snap.state_file.read_bytes())
    data[len(data) // 2 :] = b"\xff" * (len(data) - len(data) // 2)
    snap.state_file.write_bytes(bytes(data))
    workdir = places.vm_dir()
    with pytest.raises(RestoreError, match="restore failed"):
        await driver.restore(snap, RestoreSpec(workdir=workdir, net=nets.create()))
    assert leftover_files(workdir) == []


async def test_truncated_snapshot(
    driver: QemuDriver, template: Template, places: Places, nets: NetnsPool, no_leaks: None
) -> None:
    snap = copy_snapshot(template.snapshot, places)
    snap.state_file.write_bytes(snap.state_file.read_bytes()[:100])
    workdir = places.vm_dir()
    with pytest.raises(RestoreError):
        await driver.restore(snap, RestoreSpec(workdir=workdir, net=nets.create()))
    assert leftover_files(workdir) == []


async def test_missing_memory_file(
    driver: QemuDriver, template: Template, places: Places, nets: NetnsPool, no_leaks: None
) -> None:
    snap = dataclasses.replace(template.snapshot, memory_file=places.shm / "gone")
    workdir = places.vm_dir()
    with pytest.raises(RestoreError, match="missing"):
        await driver.restore(snap, RestoreSpec(workdir=workdir, net=nets.create()))
    assert leftover_files(workdir) == []


async def test_snapshot_from_another_driver(
    driver: QemuDriver, template: Template, places: Places, nets: NetnsPool, no_leaks: None
) -> None:
    for snap in (
        dataclasses.replace(template.snapshot, driver="firecracker"),
        dataclasses.replace(template.snapshot, compat="qemu-7.2.0/kvm/host:Other CPU"),
    ):
        with pytest.raises(IncompatibleSnapshotError):
            await driver.restore(snap, RestoreSpec(workdir=places.vm_dir(), net=nets.create()))
    # Snapshots taken on an older platform (before the machine was named in `compat`, before
    # TCG guests lost 5-level paging) restore on that platform, whatever ours is now; a
    # platform no driver ever had is refused.
    assert template.snapshot.compat == await driver.compat()
    for platform in driver._platforms:
        older = dataclasses.replace(template.snapshot, compat=await driver.compat_on(platform))
        assert await driver.platform_of(older) == platform
    never = Platform(driver._platforms[0].cpu, "pc")
    unknown = dataclasses.replace(template.snapshot, compat=await driver.compat_on(never))
    with pytest.raises(IncompatibleSnapshotError):
        await driver.platform_of(unknown)


async def test_snapshot_manifest_round_trip(template: Template, tmp_path: Path) -> None:
    assert Snapshot.load_manifest(template.snapshot.state_file.parent) == template.snapshot
    with pytest.raises(RestoreError, match="manifest"):
        Snapshot.load_manifest(tmp_path)


async def test_restore_many_is_all_or_nothing(
    driver: QemuDriver, template: Template, places: Places, nets: NetnsPool, no_leaks: None
) -> None:
    good = [RestoreSpec(workdir=places.vm_dir(), net=nets.create()) for _ in range(2)]
    bad = RestoreSpec(workdir=places.work / "does-not-exist", net=nets.create())
    with pytest.raises(RestoreError, match="does not exist"):
        await driver.restore_many(template.snapshot, [*good, bad])
    for spec in good:
        assert leftover_files(spec.workdir) == []


async def test_restore_refusing_share_tags_removes_its_tops(
    driver: QemuDriver, template: Template, places: Places, nets: NetnsPool, no_leaks: None
) -> None:
    """The tags are checked after the writable tops are made: the refusal takes them away."""
    workdir = places.vm_dir()
    shares = (Share(tag="not-a-slot", path=places.vm_dir()),)
    target = RestoreSpec(workdir=workdir, net=nets.create(), shares=shares)
    with pytest.raises(RestoreError, match="share tags"):
        await driver.restore(template.snapshot, target)
    assert leftover_files(workdir) == []


async def test_restore_failing_in_the_jail_leaves_nothing(
    driver: QemuDriver, template: Template, places: Places, nets: NetnsPool, no_leaks: None
) -> None:
    """A share that is not there fails the launch after its tap, cgroup, QMP socket and tops
    were made (in the jail's files when jailed, else when QEMU opens it): all are undone, and
    the VMM is not counted as this driver's any more."""
    owned = driver.owned_vmm_names()
    workdir = places.vm_dir()
    shares = (Share(tag=share_tag(0), path=places.work / "no-such-volume"),)
    target = RestoreSpec(workdir=workdir, net=nets.create(), shares=shares)
    with pytest.raises(RestoreError, match="cannot start QEMU"):
        await driver.restore(template.snapshot, target)
    assert leftover_files(workdir) == []
    assert driver.owned_vmm_names() <= owned


async def test_boot_failing_in_the_jail_removes_its_memory_file(
    driver: QemuDriver, places: Places, no_leaks: None
) -> None:
    kernel = places.vm_dir() / "kernel"  # never read: the launch fails before QEMU runs it
    kernel.write_bytes(b"not a kernel")
    workdir = places.vm_dir()
    shares = (Share(tag=share_tag(0), path=places.work / "no-such-volume"),)
    spec = VMSpec(
        vcpus=1,
        memory_mib=64,
        kernel=kernel,
        cmdline="",
        workdir=workdir,
        memory_dir=places.shm,
        shares=shares,
    )
    mem_files = set(places.shm.glob("*.mem"))
    with pytest.raises(BootError, match="cannot start QEMU"):
        await driver.boot(spec)
    assert leftover_files(workdir) == []
    assert set(places.shm.glob("*.mem")) == mem_files
