"""Real Firecracker, real guests: only where a `firecracker` binary exists and /dev/kvm runs
ordinary guests. Skipped otherwise, with the reason (on the dev machine: no firecracker binary is
installable from the reachable registries, and /dev/kvm is PVM, which cannot run them).

Boots the project's guest (Debian kernel as vmlinux, our initramfs, the base rootfs and a fresh
writable layer), waits for our init's ready marker on the console, then pauses, resumes, takes a
diff snapshot while running, restores two clones at once, snapshots a clone (diff merged over the
memory it was restored from), restores from that, and checks every VMM and cgroup is gone.
Set AENV_FIRECRACKER to use a binary that is not on PATH.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.guest.cmdline import READY_MARKER, kernel_cmdline
from aenv.guest.initramfs import MODULES, build_initramfs
from aenv.guest.kernel import fetch_kernel
from aenv.guest.rootfs import build_base_rootfs
from aenv.runtime import driver as d
from aenv.runtime.cgroups import CgroupManager, detect
from aenv.runtime.firecracker import FirecrackerConfig, FirecrackerDriver, host
from aenv.storage import layers
from tests.runtime.firecracker.fc_support import alive, pid_of
from tests.support.guest import GUEST_CACHE, MIRROR

BINARY = os.environ.get("AENV_FIRECRACKER", "firecracker")
REPO = Path(__file__).resolve().parents[3]
# Firecracker's balloon (free page reporting, statistics) and entropy devices need their guest
# drivers, which are modules in Debian's kernel.
FIRECRACKER_MODULES = (*MODULES, "virtio_balloon", "virtio_rng")


def _why_not_live() -> str | None:
    if host.find_binary(BINARY) is None:
        return (
            f"no {BINARY!r} binary on this host (none is installable from the registries "
            "reachable here; set AENV_FIRECRACKER to one)"
        )
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "/dev/kvm is missing or not accessible"
    if host.accelerator() == "pvm":
        return (
            "/dev/kvm is PVM (kvm_pvm, no hardware virtualization): it cannot run the ordinary "
            "guests an upstream Firecracker boots"
        )
    return None


REASON = _why_not_live()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


@pytest.fixture(scope="module")
def shm() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="aenv-fc-live-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def live_cgroups() -> Iterator[CgroupManager]:
    manager = detect(f"aenv-fc-live-{secrets.token_hex(3)}-{os.getpid()}")
    yield manager
    assert manager.names() == [], "a VMM cgroup was left behind"
    manager.remove_parent()


async def wait_for_console(vm: d.VM, marker: str, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while marker not in vm.console_log.read_text(errors="replace"):
        assert vm.state is not d.VMState.STOPPED
        if time.monotonic() > deadline:
            tail = vm.console_log.read_text(errors="replace")[-2000:]
            pytest.fail(f"{marker!r} not on the console in {limit_s:.0f}s:\n{tail}")
        await asyncio.sleep(0.1)


async def test_boot_snapshot_clone_restore(
    tmp_path: Path, shm: Path, live_cgroups: CgroupManager
) -> None:
    kernel = await fetch_kernel(GUEST_CACHE)
    initrd = await build_initramfs(kernel, GUEST_CACHE, modules=FIRECRACKER_MODULES)
    rootfs = await build_base_rootfs(GUEST_CACHE, MIRROR)
    driver = FirecrackerDriver(FirecrackerConfig(binary=Path(BINARY)), live_cgroups)

    workdir = tmp_path / "source"
    workdir.mkdir()
    upper = await layers.new_upper(workdir / "upper.img", 512)
    spec = d.VMSpec(
        vcpus=1,
        memory_mib=256,
        kernel=kernel.vmlinux,
        initrd=initrd,
        cmdline=kernel_cmdline(hostname="sandbox"),
        workdir=workdir,
        disks=(d.Disk("root", rootfs.image, read_only=True), d.Disk("upper", upper)),
    )
    source = await driver.boot(spec)
    vms: list[d.VM] = [source]
    try:
        await wait_for_console(source, READY_MARKER)
        await source.pause()
        await source.resume()
        target = d.SnapshotTarget(directory=tmp_path / "snap1", memory_dir=shm / "snap1")
        snap = await source.snapshot(target, keep_running=True)
        assert source.state is d.VMState.RUNNING
        assert snap.memory_file is not None and snap.memory_file.stat().st_size == 256 << 20

        targets = []
        for i in range(2):
            (tmp_path / f"clone{i}").mkdir()
            targets.append(d.RestoreSpec(workdir=tmp_path / f"clone{i}"))
        clones = await driver.restore_many(snap, targets)
        vms += clones
        await asyncio.sleep(1)  # a guest that crashed on restore takes its VMM down
        for clone in clones:
            assert alive(pid_of(clone)) and clone.state is d.VMState.RUNNING
            stats = await clone.stats()
            assert 0 < stats.pss_bytes <= stats.rss_bytes

        target = d.SnapshotTarget(directory=tmp_path / "snap2", memory_dir=shm / "snap2")
        snap2 = await clones[0].snapshot(target, keep_running=False)
        (tmp_path / "again").mkdir()
        again = await driver.restore(snap2, d.RestoreSpec(workdir=tmp_path / "again"))
        vms.append(again)
        await asyncio.sleep(1)
        assert alive(pid_of(again)) and again.state is d.VMState.RUNNING
    finally:
        pids = [pid_of(vm) for vm in vms if vm.state is not d.VMState.STOPPED]
        await asyncio.gather(*(vm.stop() for vm in vms))
    assert not any(alive(pid) for pid in pids)
