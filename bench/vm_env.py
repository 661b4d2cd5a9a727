"""What the driver-level benchmarks (runtime, jail, discard) run on: the guest images (kernel,
initramfs, base rootfs, the stand-in agent bundle), scratch directories on disk and on /dev/shm,
a cgroup parent and network namespaces, all removed afterwards; and the accelerator
(`AENV_BENCH_ACCEL=kvm`, else TCG)."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from aenv.config import DEFAULT_MIRROR
from aenv.guest.initramfs import build_initramfs
from aenv.guest.kernel import fetch_kernel
from aenv.guest.rootfs import build_base_rootfs
from aenv.runtime.cgroups import CgroupManager, detect
from aenv.runtime.qemu import Accel
from tests.runtime.qemu_vm.agent import build_agent_bundle
from tests.runtime.qemu_vm.netns import NetnsPool

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class VmEnv:
    work: Path
    shm: Path
    cgroups: CgroupManager
    nets: NetnsPool
    images: dict[str, Path]
    accel: Accel


@asynccontextmanager
async def vm_env() -> AsyncIterator[VmEnv]:
    guest_cache = Path(os.environ.get("AENV_GUEST_CACHE", str(REPO / "build" / "guest-cache")))
    mirror = os.environ.get("AENV_DEBIAN_MIRROR", DEFAULT_MIRROR)
    accel: Accel = "kvm" if os.environ.get("AENV_BENCH_ACCEL") == "kvm" else "tcg"
    kernel = await fetch_kernel(guest_cache)
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-"))
    shm = Path(tempfile.mkdtemp(prefix="aenv-bench-", dir="/dev/shm"))
    cgroups = detect(f"aenv-bench-{secrets.token_hex(3)}")
    nets = NetnsPool()
    try:
        images = {
            "kernel": kernel.bzimage,
            "initrd": await build_initramfs(kernel, guest_cache),
            "rootfs": (await build_base_rootfs(guest_cache, mirror)).image,
            "bundle": await build_agent_bundle(work),
        }
        yield VmEnv(work, shm, cgroups, nets, images, accel)
    finally:
        nets.delete_all()
        cgroups.remove_parent()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
