"""Session fixtures: build guest images once, boot one template VM once, snapshot it; every test
restores from that snapshot. Every VM, namespace, cgroup and temp file is released on teardown,
also when a test fails; `no_leaks` then checks that nothing is left behind. Every VMM booted or
restored here is checked to be jailed (`tests.support.jail`), its root showing only files under
the test's directories and the guest images."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from aenv.guest.cmdline import kernel_cmdline
from aenv.guest.initramfs import build_initramfs
from aenv.guest.kernel import Kernel, fetch_kernel
from aenv.guest.rootfs import BaseRootfs, build_base_rootfs
from aenv.runtime.cgroups import CgroupManager, detect
from aenv.runtime.driver import (
    VM,
    Disk,
    RestoreSpec,
    Share,
    Snapshot,
    SnapshotTarget,
    VMSpec,
)
from aenv.runtime.qemu import Accel, QemuConfig, QemuDriver, QemuVM
from aenv.storage import layers
from tests.runtime.qemu_vm.agent import build_agent_bundle
from tests.runtime.qemu_vm.netns import GUEST_NET, NetnsPool, agent, wait_ready
from tests.support.guest import GUEST_CACHE, MIRROR
from tests.support.jail import jail_problems

REPO = Path(__file__).resolve().parents[3]
TEMPLATE_MEMORY = "remembered-in-ram"
TEMPLATE_NOTE = "written-to-disk"


@dataclass(frozen=True)
class Images:
    kernel: Kernel
    initrd: Path
    rootfs: BaseRootfs
    bundle: Path


@dataclass
class Places:
    """Fresh directories for VMs (`work`) and for memory files (`shm`, on tmpfs)."""

    work: Path
    shm: Path
    count: int = 0

    def jail_roots(self) -> list[Path]:
        """Where the files a VMM of these tests may see are: the test's directories (the guest
        agent's bundle is in pytest's temporary tree too) and the guest image cache."""
        return [self.work.parent, self.shm, GUEST_CACHE]

    def check_jailed(self, driver: QemuDriver, vm: VM) -> VM:
        assert isinstance(vm, QemuVM)
        if driver.config.jail is not None:
            shares = bool(vm.spec.shares)
            assert jail_problems(vm.proc.pid, self.jail_roots(), shares=shares) == []
        return vm

    def vm_dir(self) -> Path:
        self.count += 1
        path = self.work / f"vm{self.count}"
        path.mkdir()
        return path

    def snapshot_target(self) -> SnapshotTarget:
        self.count += 1
        directory = self.work / f"snap{self.count}"
        memory = self.shm / f"snap{self.count}"
        directory.mkdir()
        memory.mkdir()
        return SnapshotTarget(directory=directory, memory_dir=memory)


@pytest.fixture(scope="session")
def places(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Places]:
    shm = Path(tempfile.mkdtemp(prefix="aenv-test-", dir="/dev/shm"))
    work = tmp_path_factory.mktemp("qemu")
    try:
        yield Places(work=work, shm=shm)
    finally:
        # Snapshots hold full-RAM state files and disk layers: do not leave them to pytest's
        # retention of old temp dirs.
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="session")
async def images(tmp_path_factory: pytest.TempPathFactory) -> Images:
    # Guest artifacts are cached in the repository's build/ (gitignored), built once per checkout.
    kernel = await fetch_kernel(GUEST_CACHE)
    initrd = await build_initramfs(kernel, GUEST_CACHE)
    rootfs = await build_base_rootfs(GUEST_CACHE, MIRROR)
    bundle = await build_agent_bundle(tmp_path_factory.mktemp("bundle"))
    return Images(kernel=kernel, initrd=initrd, rootfs=rootfs, bundle=bundle)


@pytest.fixture(scope="session")
def nets() -> Iterator[NetnsPool]:
    pool = NetnsPool()
    try:
        yield pool
    finally:
        pool.delete_all()


@pytest.fixture(scope="session")
def cgroups() -> Iterator[CgroupManager]:
    manager = detect(f"aenv-test-{secrets.token_hex(3)}-{os.getpid()}")
    try:
        yield manager
    finally:
        manager.remove_parent()


@pytest.fixture(scope="session")
def driver(cgroups: CgroupManager) -> QemuDriver:
    accel: Accel = "kvm" if os.environ.get("AENV_TEST_ACCEL") == "kvm" else "tcg"
    return QemuDriver(QemuConfig(accel=accel), cgroups=cgroups)


async def boot_template(
    driver: QemuDriver,
    images: Images,
    places: Places,
    nets: NetnsPool,
    upper_mib: int = 1024,
    memory_mib: int = 256,
) -> tuple[VM, str]:
    workdir = places.vm_dir()
    upper = await layers.new_upper(workdir / "upper.img", upper_mib)
    net = nets.create()
    spec = VMSpec(
        vcpus=1,
        memory_mib=memory_mib,
        kernel=images.kernel.bzimage,
        initrd=images.initrd,
        cmdline=kernel_cmdline(GUEST_NET, hostname="sandbox"),
        workdir=workdir,
        disks=(
            Disk("root", images.rootfs.image, read_only=True),
            Disk("upper", upper),
            Disk("envd", images.bundle, read_only=True),
        ),
        net=net,
        memory_dir=places.shm,
    )
    return places.check_jailed(driver, await driver.boot(spec)), net.netns


@dataclass(frozen=True)
class Template:
    snapshot: Snapshot
    boot_to_ready_s: float


@pytest.fixture(scope="session")
async def template(
    driver: QemuDriver, images: Images, places: Places, nets: NetnsPool
) -> AsyncIterator[Template]:
    vm, netns = await boot_template(driver, images, places, nets)
    try:
        ready = await wait_ready(netns)
        await agent(netns, "POST", f"/?memory={TEMPLATE_MEMORY}&note={TEMPLATE_NOTE}")
        snap = await vm.snapshot(places.snapshot_target(), keep_running=False)
    finally:
        await vm.stop()
    yield Template(snapshot=snap, boot_to_ready_s=ready)


class Fleet:
    """Restores VMs for one test and stops them all afterwards."""

    def __init__(self, driver: QemuDriver, places: Places, nets: NetnsPool) -> None:
        self.driver = driver
        self.places = places
        self.nets = nets
        self.vms: list[VM] = []

    def target(self, shares: tuple[Share, ...] = ()) -> RestoreSpec:
        return RestoreSpec(
            workdir=self.places.vm_dir(),
            net=self.nets.create(),
            memory_dir=self.places.shm,
            shares=shares,
        )

    async def restore(self, snapshot: Snapshot, shares: tuple[Share, ...] = ()) -> tuple[VM, str]:
        target = self.target(shares)
        vm = await self.driver.restore(snapshot, target)
        self.vms.append(vm)
        self.places.check_jailed(self.driver, vm)
        assert target.net is not None
        return vm, target.net.netns

    async def restore_many(self, snapshot: Snapshot, count: int) -> list[tuple[VM, str]]:
        targets = [self.target() for _ in range(count)]
        vms = await self.driver.restore_many(snapshot, targets)
        self.vms += vms
        for vm in vms:
            self.places.check_jailed(self.driver, vm)
        return [(vm, t.net.netns) for vm, t in zip(vms, targets, strict=True) if t.net]

    async def stop_all(self) -> None:
        for vm in self.vms:
            await vm.stop()


def qemu_children() -> list[psutil.Process]:
    found = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # gone, or a zombie: not running
            if "qemu" in " ".join(proc.cmdline()):
                found.append(proc)
    return found


@pytest.fixture
def no_leaks(cgroups: CgroupManager) -> Iterator[None]:
    yield
    assert qemu_children() == [], "a QEMU process outlived its test"
    assert cgroups.names() == [], "a VMM cgroup outlived its test"


@pytest.fixture
async def fleet(
    driver: QemuDriver, places: Places, nets: NetnsPool, template: Template, no_leaks: None
) -> AsyncIterator[Fleet]:
    f = Fleet(driver, places, nets)
    try:
        yield f
    finally:
        await f.stop_all()
