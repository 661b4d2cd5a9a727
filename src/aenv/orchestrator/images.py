"""The guest artifacts every template build needs: kernel, initramfs, base root filesystem and
the envd bundle drive, published as immutable, content-addressed files.

Saved VMs (templates, snapshots, paused sandboxes) name these files by absolute path, and their
memory holds the page cache and running processes of exactly that content: a file rewritten under
the same path breaks them all (envd's reads fail with decompression errors). So each artifact is
published into `<cache>/images/` under a name carrying a short sha256 (`rootfs-<sha>.ext4`), and
a published file is never written again: a rebuild gets a new name, and the old file stays for
whatever still refers to it. `GuestImages.identity` tells templates which set they were built from.

The kernel, initramfs and rootfs come from the guest build cache and are hard-linked (copied
across filesystems), which costs no space and keeps the content even if that cache entry is
removed and rebuilt. The envd drive is named after the bundle it holds, so it is built once per
bundle content.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from aenv.envd_bundle.build import build_bundle
from aenv.guest.bundle import build_envd_drive
from aenv.guest.initramfs import build_initramfs
from aenv.guest.kernel import fetch_kernel
from aenv.guest.rootfs import build_base_rootfs
from aenv.runtime.driver import Driver, KernelImages

IMAGES_DIR = "images"
DIGEST_CHARS = 16  # 64 bits of sha256: no accidental collision among a host's images
_CHUNK = 1 << 20


@dataclass(frozen=True)
class GuestImages:
    kernel: Path  # what VMs boot: the bzImage until `booted_by` picks the driver's form
    vmlinux: Path  # the same kernel uncompressed
    initrd: Path
    rootfs: Path  # ext4, shared read-only by every sandbox of the template
    envd_drive: Path  # ext4 with the self-contained envd, mounted at /opt/aenv

    @property
    def identity(self) -> str:
        """A digest of the files a VM built from these images uses (names carry content hashes,
        so equal identities mean equal content). `kernel` is whichever kernel the driver boots."""
        names = (self.kernel.name, self.initrd.name, self.rootfs.name, self.envd_drive.name)
        return hashlib.sha256("\n".join(names).encode()).hexdigest()[:DIGEST_CHARS]

    def booted_by(self, driver: Driver) -> GuestImages:
        """These images as `driver`'s VMs boot them: `kernel` in the form it loads."""
        kernel = driver.kernel_image(KernelImages(bzimage=self.kernel, vmlinux=self.vmlinux))
        return dataclasses.replace(self, kernel=kernel)


def envd_bundle_dir(guest_cache: Path) -> Path:
    """Where the envd bundle is built: in the guest build cache, so that the nodes (and test
    servers) sharing one build it once."""
    return guest_cache / "envd"


async def prepare_images(cache: Path, guest_cache: Path, mirror: str) -> GuestImages:
    """The images under `cache`, built from the guest build cache `guest_cache` (the base root
    filesystem bootstrapped from Debian `mirror`). The envd bundle is built there too, so nodes
    sharing a guest cache build it once (47 s of CPU, a venv and PyInstaller, each time)."""
    kernel = await fetch_kernel(guest_cache)
    initrd, rootfs, bundle = await asyncio.gather(
        build_initramfs(kernel, guest_cache),
        build_base_rootfs(guest_cache, mirror),
        asyncio.to_thread(build_bundle, envd_bundle_dir(guest_cache)),
    )
    if guest_cache.resolve() != cache.resolve():
        for stale in ("envd", "envd-build"):  # where versions before 2026-12-05 built it
            await asyncio.to_thread(shutil.rmtree, cache / stale, True)
    store = cache / IMAGES_DIR
    store.mkdir(parents=True, exist_ok=True)
    bzimage, vmlinux, initrd_image, rootfs_image = await asyncio.gather(
        asyncio.to_thread(publish, kernel.bzimage, store, "kernel", ".bzImage"),
        asyncio.to_thread(publish, kernel.vmlinux, store, "vmlinux", ""),
        asyncio.to_thread(publish, initrd, store, "initrd", ".cpio.gz"),
        asyncio.to_thread(publish, rootfs.image, store, "rootfs", ".ext4"),
    )
    drive = await envd_drive(bundle.parent, store)
    return GuestImages(bzimage, vmlinux, initrd_image, rootfs_image, drive)


def publish(source: Path, store: Path, stem: str, suffix: str) -> Path:
    """`store/<stem>-<sha><suffix>` with the content of `source`, linked or copied once."""
    for published in store.glob(f"{stem}-*{suffix}"):
        if published.samefile(source):  # linked before: skip reading it again
            return published
    target = store / f"{stem}-{file_digest(source)}{suffix}"
    if target.exists():  # the same content, published before from another copy
        return target
    tmp = _scratch(target)
    try:
        try:
            os.link(source, tmp)
        except OSError:  # another filesystem
            shutil.copy2(source, tmp)
        return _install(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


async def envd_drive(bundle: Path, store: Path) -> Path:
    """The drive holding bundle directory `bundle`, built unless one with its content exists."""
    drive = store / f"envd-{await asyncio.to_thread(tree_digest, bundle)}.ext4"
    if drive.exists():
        return drive
    tmp = _scratch(drive)
    try:
        await build_envd_drive(bundle, tmp)
        return await asyncio.to_thread(_install, tmp, drive)
    finally:
        tmp.unlink(missing_ok=True)


def _scratch(target: Path) -> Path:
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    return tmp


def _install(tmp: Path, target: Path) -> Path:
    """Give `tmp` its final name unless another process got there first: a published file is
    never replaced, not even by equal content (an ext4 image rebuilt from the same tree differs
    in its UUID and timestamps, and a saved VM's page cache holds the old bytes)."""
    with contextlib.suppress(FileExistsError):
        os.link(tmp, target)
    return target


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()[:DIGEST_CHARS]


def tree_digest(root: Path) -> str:
    """Content identity of a directory tree: names, permission bits, symlink targets and file
    contents (what ends up inside an ext4 image made from it), not timestamps."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):  # does not descend into symlinked directories
        rel = path.relative_to(root).as_posix()
        mode = path.lstat().st_mode & 0o7777
        if path.is_symlink():
            h.update(f"L {rel} {os.readlink(path)}\n".encode())
        elif path.is_dir():
            h.update(f"D {rel} {mode:o}\n".encode())
        else:
            h.update(f"F {rel} {mode:o} {file_digest(path)}\n".encode())
    return h.hexdigest()[:DIGEST_CHARS]
