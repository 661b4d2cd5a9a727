"""The guest kernel: Debian's `linux-image-amd64` package, downloaded and unpacked, never installed.

QEMU boots the compressed `bzImage` (`vmlinuz`); Firecracker needs the uncompressed ELF `vmlinux`,
which `extract_vmlinux` recovers from the bzImage (the package ships no vmlinux). Modules stay in
the cache entry for the initramfs builder. An operator can skip all this with a kernel of their own.
"""

from __future__ import annotations

import asyncio
import lzma
import re
import shutil
import subprocess
import zlib
from dataclasses import dataclass
from pathlib import Path

from aenv.guest.cache import cached_dir
from aenv.guest.proc import BuildError, run

META_PACKAGE = "linux-image-amd64"
ELF_MAGIC = b"\x7fELF"
# Compressed payload signatures inside a bzImage, tried in file order (same idea as the kernel's
# scripts/extract-vmlinux).
_MAGICS = {
    "gzip": b"\x1f\x8b\x08",
    "xz": b"\xfd7zXZ\x00",
    "zstd": b"\x28\xb5\x2f\xfd",
}


@dataclass(frozen=True)
class Kernel:
    version: str
    bzimage: Path
    vmlinux: Path
    modules: Path  # lib/modules/<version>
    config: Path


async def resolve_package(meta: str = META_PACKAGE) -> str:
    """The concrete `linux-image-<version>` the meta package currently depends on."""
    out = await run("apt-cache", "depends", meta)
    match = re.search(r"Depends:\s*(linux-image-\S+)", out)
    if not match:
        raise BuildError(f"cannot resolve kernel package from {meta!r}: {out.strip()[:200]}")
    return match.group(1)


async def fetch_kernel(cache: Path, package: str | None = None) -> Kernel:
    """Download + unpack the kernel package (cached in `cache` by package name) and extract its
    vmlinux."""
    pkg = package or await resolve_package()

    async def build(tmp: Path) -> None:
        dl = tmp / "download"
        dl.mkdir()
        await run("apt-get", "download", "-q", pkg, cwd=dl)
        debs = list(dl.glob("*.deb"))
        if len(debs) != 1:
            raise BuildError(f"apt-get download {pkg} produced {debs}")
        root = tmp / "root"
        await run("dpkg-deb", "-x", debs[0], root)
        await asyncio.to_thread(shutil.rmtree, dl)
        vmlinuz = _one(root / "boot", "vmlinuz-*")
        await asyncio.to_thread(_write_vmlinux, vmlinuz, tmp / "vmlinux")

    entry = await cached_dir("kernel", {"package": pkg, "layout": 1}, build, cache)
    vmlinuz = _one(entry / "root" / "boot", "vmlinuz-*")
    version = vmlinuz.name.removeprefix("vmlinuz-")
    return Kernel(
        version=version,
        bzimage=vmlinuz,
        vmlinux=entry / "vmlinux",
        modules=entry / "root" / "lib" / "modules" / version,
        config=entry / "root" / "boot" / f"config-{version}",
    )


def extract_vmlinux(bzimage: bytes) -> bytes:
    """Find the compressed kernel inside a bzImage and return the ELF image it holds."""
    for name, magic in _MAGICS.items():
        start = bzimage.find(magic)
        while start != -1:
            try:
                data = _decompress(name, bzimage[start:])
            except (OSError, lzma.LZMAError, zlib.error, BuildError):
                data = b""
            if data.startswith(ELF_MAGIC):
                return data
            start = bzimage.find(magic, start + 1)
    raise BuildError("no compressed ELF kernel found in bzImage")


def _decompress(kind: str, blob: bytes) -> bytes:
    if kind == "gzip":
        return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(blob)
    if kind == "xz":
        return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(blob)
    # zstd has no stdlib decoder; the zstd tool is a system dependency.
    proc = subprocess.run(["zstd", "-dcq"], input=blob, capture_output=True, check=False)
    return proc.stdout


def _write_vmlinux(vmlinuz: Path, out: Path) -> None:
    out.write_bytes(extract_vmlinux(vmlinuz.read_bytes()))


def _one(directory: Path, pattern: str) -> Path:
    found = sorted(directory.glob(pattern))
    if len(found) != 1:
        raise BuildError(f"expected one {pattern} in {directory}, found {found}")
    return found[0]
