"""Which VMM backend this host runs: firecracker (binary + working KVM) > qemu+KVM > qemu+TCG.

"Working KVM" is decided by booting a guest, not by opening /dev/kvm: a PVM host (KVM without
hardware virtualization, like the dev machine) opens the device, creates VMs and even runs small
hand-made guests in real, protected and long mode, yet an ordinary kernel hangs early in boot. So
the probe boots the real guest kernel under QEMU with KVM and waits for it to start its init
(`rdinit=/bin/busybox` prints usage and exits, the kernel panics, QEMU exits). That takes 4.6 s
under TCG here, so well under the 5 s limit with KVM (not measurable on this machine); on a
broken host the probe times out, and a configured backend skips it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from aenv.runtime.cgroups import CgroupManager
from aenv.runtime.driver import Driver
from aenv.runtime.firecracker import FirecrackerConfig, FirecrackerDriver
from aenv.runtime.jail import JailConfig
from aenv.runtime.qemu import SHARE_SLOTS, TCG_TB_MIB, Accel, QemuConfig, QemuDriver

KVM_DEVICE = Path("/dev/kvm")
INIT_STARTED = "Run /bin/busybox as init process"


class Backend(enum.StrEnum):
    FIRECRACKER = "firecracker"
    QEMU_KVM = "qemu-kvm"
    QEMU_TCG = "qemu-tcg"


@dataclass(frozen=True)
class Selection:
    backend: Backend
    reason: str


async def kvm_boots_guests(
    kernel: Path,
    initrd: Path,
    *,
    qemu: str = "qemu-system-x86_64",
    device: Path = KVM_DEVICE,
    limit_s: float = 5.0,
) -> tuple[bool, str]:
    """Boot `kernel` under QEMU+KVM until it runs its first userspace program."""
    try:
        fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
        os.close(fd)
    except OSError as exc:
        return False, f"cannot open {device}: {exc.strerror}"
    with tempfile.TemporaryDirectory(prefix="aenv-kvm-probe-") as tmp:
        console = Path(tmp) / "console.log"
        proc = await asyncio.create_subprocess_exec(
            qemu,
            "-accel", "kvm",
            "-M", "microvm,x-option-roms=off,rtc=on",
            "-cpu", "host",
            "-m", "128M",
            "-display", "none",
            "-monitor", "none",
            "-no-reboot",
            "-serial", f"file:{console}",
            "-kernel", str(kernel),
            "-initrd", str(initrd),
            "-append", "console=ttyS0 panic=-1 rdinit=/bin/busybox",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            _, err = await asyncio.wait_for(proc.communicate(), limit_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return False, f"a guest kernel under KVM did not reach init in {limit_s:.0f}s"
        with contextlib.suppress(OSError):
            if INIT_STARTED in console.read_text(errors="replace"):
                return True, "KVM boots guests"
        return False, f"QEMU+KVM failed ({proc.returncode}): {err.decode().strip()[-300:]}"


async def select_backend(
    preference: str = "auto",
    *,
    kernel: Path,
    initrd: Path,
    firecracker_binary: str = "firecracker",
    qemu_binary: str = "qemu-system-x86_64",
) -> Selection:
    """`preference` is `auto` or a `Backend` value (config override, taken as given)."""
    if preference != "auto":
        return Selection(Backend(preference), "forced by configuration")
    if shutil.which(qemu_binary) is None and shutil.which(firecracker_binary) is None:
        raise RuntimeError(f"neither {firecracker_binary} nor {qemu_binary} is installed")
    kvm_ok, why = await kvm_boots_guests(kernel, initrd, qemu=qemu_binary)
    if kvm_ok and shutil.which(firecracker_binary):
        return Selection(Backend.FIRECRACKER, f"{why}; {firecracker_binary} found")
    if kvm_ok:
        return Selection(Backend.QEMU_KVM, f"{why}; no {firecracker_binary}")
    return Selection(Backend.QEMU_TCG, why)


def driver_for(
    selection: Selection,
    *,
    cgroups: CgroupManager | None,
    firecracker: FirecrackerConfig,
    jail: JailConfig | None,
    tb_size_mib: int = TCG_TB_MIB,
    share_slots: int = SHARE_SLOTS,
) -> Driver:
    """The driver of the selected backend; `cgroups` holds QEMU's VMMs (Firecracker's config
    names its own cgroup parent and its jailer); `jail` None runs QEMU's VMMs unconfined;
    `tb_size_mib` is QEMU's TCG translation cache, `share_slots` its VMs' share devices."""
    if selection.backend is Backend.FIRECRACKER:
        return FirecrackerDriver(firecracker)
    return qemu_driver(
        selection, cgroups=cgroups, jail=jail, tb_size_mib=tb_size_mib, share_slots=share_slots
    )


def qemu_driver(
    selection: Selection,
    cgroups: CgroupManager | None = None,
    jail: JailConfig | None = None,
    tb_size_mib: int = TCG_TB_MIB,
    share_slots: int = SHARE_SLOTS,
) -> QemuDriver:
    """The QEMU driver for a qemu selection (the firecracker driver is built by its package);
    `jail` None runs its VMMs unconfined."""
    accel: Accel
    if selection.backend is Backend.QEMU_KVM:
        accel = "kvm"
    elif selection.backend is Backend.QEMU_TCG:
        accel = "tcg"
    else:
        raise ValueError(f"{selection.backend} is not a qemu backend")
    config = QemuConfig(accel=accel, jail=jail, tb_size_mib=tb_size_mib, share_slots=share_slots)
    return QemuDriver(config, cgroups=cgroups)
