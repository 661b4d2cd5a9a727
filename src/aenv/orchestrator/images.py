"""The guest artifacts every template build needs: kernel, initramfs, base root filesystem and
the envd bundle drive. Each is built once per set of inputs and cached."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from aenv.envd_bundle.build import build_bundle
from aenv.guest.bundle import build_envd_drive
from aenv.guest.initramfs import build_initramfs
from aenv.guest.kernel import fetch_kernel
from aenv.guest.rootfs import build_base_rootfs


@dataclass(frozen=True)
class GuestImages:
    kernel: Path  # bzImage
    vmlinux: Path  # uncompressed, for Firecracker
    initrd: Path
    rootfs: Path  # ext4, shared read-only by every sandbox of the template
    envd_drive: Path  # ext4 with the self-contained envd, mounted at /opt/aenv


async def prepare_images(cache: Path) -> GuestImages:
    kernel = await fetch_kernel()
    initrd, rootfs, bundle = await asyncio.gather(
        build_initramfs(kernel),
        build_base_rootfs(),
        asyncio.to_thread(build_bundle, cache / "envd"),
    )
    drive = cache / "envd-drive.ext4"
    stamp = cache / "envd-drive.source"
    source = str(bundle.stat().st_mtime_ns)
    if not drive.exists() or not stamp.exists() or stamp.read_text() != source:
        tmp = drive.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        await build_envd_drive(bundle.parent, tmp)
        tmp.replace(drive)
        stamp.write_text(source)
    return GuestImages(kernel.bzimage, kernel.vmlinux, initrd, rootfs.image, drive)
