"""Module load order and the real initramfs built from Debian's kernel package."""

from __future__ import annotations

import gzip
import subprocess
from pathlib import Path

import pytest

from aenv.guest.initramfs import build_initramfs, module_order
from aenv.guest.kernel import fetch_kernel
from aenv.guest.proc import BuildError
from tests.support.guest import GUEST_CACHE

REPO = Path(__file__).resolve().parents[2]


def test_dependencies_load_first() -> None:
    deps = {
        "virtio_blk": ("virtio", "virtio_ring"),
        "virtio": ("virtio_ring",),
        "virtio_ring": (),
        "ext4": ("jbd2",),
        "jbd2": (),
    }
    order = module_order(deps, ["virtio_blk", "ext4"])
    assert order == ["virtio_ring", "virtio", "virtio_blk", "jbd2", "ext4"]


def test_cycle_is_an_error() -> None:
    with pytest.raises(BuildError, match="cycle"):
        module_order({"a": ("b",), "b": ("a",)}, ["a"])


@pytest.mark.slow
async def test_initramfs_from_the_debian_kernel() -> None:
    kernel = await fetch_kernel(GUEST_CACHE)
    assert kernel.vmlinux.read_bytes()[:4] == b"\x7fELF"
    initrd = await build_initramfs(kernel, GUEST_CACHE)
    assert initrd == await build_initramfs(kernel, GUEST_CACHE)  # cached
    listing = subprocess.run(
        ["cpio", "-t", "--quiet"], input=gzip.decompress(initrd.read_bytes()),
        capture_output=True, check=True,
    ).stdout.decode().split()  # fmt: skip
    assert {"init", "stage2", "bin/busybox", "bin/aenv-init", "modules.order"} <= set(listing)
    order = (initrd.parent / "modules.order").read_text().split()
    assert order.index("virtio_ring.ko") < order.index("virtio.ko") < order.index("virtio_blk.ko")
    assert order.index("crc32c_generic.ko") < order.index("ext4.ko")
    assert "overlay.ko" in order
    # Firecracker's balloon and entropy devices (virtio-rng.ko: Debian's file name has a dash).
    assert order.index("virtio.ko") < order.index("virtio_balloon.ko")
    assert order.index("virtio.ko") < order.index("virtio-rng.ko")
    # Volumes: 9p over virtio, its transport first.
    assert order.index("9pnet.ko") < order.index("9pnet_virtio.ko") < order.index("9p.ko")
