"""Backend selection: forced choices, and the real KVM probe on this host."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.guest.initramfs import build_initramfs
from aenv.guest.kernel import fetch_kernel
from aenv.runtime.firecracker import FirecrackerConfig, FirecrackerDriver
from aenv.runtime.jail import JailConfig
from aenv.runtime.qemu import SHARE_SLOTS, QemuDriver
from aenv.runtime.select import (
    Backend,
    Selection,
    driver_for,
    kvm_boots_guests,
    qemu_driver,
    select_backend,
)
from tests.support.guest import GUEST_CACHE

REPO = Path(__file__).resolve().parents[2]


async def test_forced_backend(tmp_path: Path) -> None:
    chosen = await select_backend("qemu-tcg", kernel=tmp_path / "k", initrd=tmp_path / "i")
    assert chosen == Selection(Backend.QEMU_TCG, "forced by configuration")
    assert qemu_driver(chosen).config.accel == "tcg"
    assert qemu_driver(chosen).config.share_slots == SHARE_SLOTS
    assert qemu_driver(chosen, share_slots=0).config.share_slots == 0
    with pytest.raises(ValueError):
        qemu_driver(Selection(Backend.FIRECRACKER, "x"))


async def test_probe_without_device(tmp_path: Path) -> None:
    ok, reason = await kvm_boots_guests(tmp_path / "k", tmp_path / "i", device=tmp_path / "kvm")
    assert not ok and "cannot open" in reason


@pytest.mark.slow
async def test_probe_boots_the_real_kernel() -> None:
    if not Path("/dev/kvm").exists():
        pytest.skip("no /dev/kvm")
    kernel = await fetch_kernel(GUEST_CACHE)
    ok, reason = await kvm_boots_guests(
        kernel.bzimage, await build_initramfs(kernel, GUEST_CACHE), limit_s=10
    )
    if Path("/sys/module/kvm_pvm").exists() and not Path("/sys/module/kvm_intel").exists():
        # PVM opens /dev/kvm and creates VMs, but an ordinary kernel never reaches init.
        assert not ok, reason
    assert reason


def test_driver_for_each_backend() -> None:
    config = FirecrackerConfig()
    jail = JailConfig(uid_base=200000, uid_count=16)
    firecracker = driver_for(
        Selection(Backend.FIRECRACKER, "x"), cgroups=None, firecracker=config, jail=jail
    )
    assert isinstance(firecracker, FirecrackerDriver) and firecracker.config is config
    qemu = driver_for(Selection(Backend.QEMU_KVM, "x"), cgroups=None, firecracker=config, jail=jail)
    assert isinstance(qemu, QemuDriver) and qemu.config.accel == "kvm"
    assert qemu.config.jail is jail
