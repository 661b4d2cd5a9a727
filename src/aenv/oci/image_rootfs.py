"""An image's guest root filesystem: pull, unpack the layers, prepare the tree for our init,
and seal it as the read-only ext4 image (label aenv-root) a template boots from."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aenv.guest.cmdline import ROOT_LABEL
from aenv.guest.rootfs import make_ext4
from aenv.oci.inject import prepare_guest_tree
from aenv.oci.pull import Platform, ProgressCallback, PulledImage, pull
from aenv.oci.registry import Credentials
from aenv.oci.unpack import apply_layer


@dataclass(frozen=True)
class ImageConfig:
    """The runtime defaults an image declares (its config's `config` object)."""

    env: tuple[str, ...] = ()  # "KEY=value", in image order
    working_dir: str | None = None
    user: str | None = None
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()

    @classmethod
    def from_document(cls, config: dict[str, Any]) -> ImageConfig:
        c = config.get("config") or {}
        return cls(
            env=tuple(c.get("Env") or ()),
            working_dir=c.get("WorkingDir") or None,
            user=c.get("User") or None,
            entrypoint=tuple(c.get("Entrypoint") or ()),
            cmd=tuple(c.get("Cmd") or ()),
        )

    def env_dict(self) -> dict[str, str]:
        return dict(item.partition("=")[::2] for item in self.env)


@dataclass(frozen=True)
class ImageRootfs:
    image: Path  # the ext4 file (== `dest`)
    reference: str  # as parsed, e.g. docker.io/library/alpine:3.20
    digest: str  # the platform manifest's digest: what exactly was built
    platform: Platform
    config: ImageConfig


async def rootfs_from_image(
    ref: str,
    dest: Path,
    *,
    cache: Path,
    credentials: Credentials | None = None,
    progress: ProgressCallback | None = None,
    platform: Platform | None = None,
) -> ImageRootfs:
    """Pull `ref` (blobs cached under `cache`), and write its guest root filesystem to `dest`.
    `dest` appears complete or not at all; the unpacked tree is removed either way."""
    pulled = await pull(ref, cache, credentials=credentials, platform=platform, progress=progress)
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        tree = work / "tree"
        tree.mkdir()
        await asyncio.to_thread(_unpack, pulled, tree)
        size_mib = await asyncio.to_thread(_ext4_size_mib, tree)
        partial = await make_ext4(
            tree, work / "rootfs.ext4", label=ROOT_LABEL, size_mib=size_mib, read_only=True
        )
        partial.replace(dest)
    finally:
        await asyncio.to_thread(shutil.rmtree, work, True)
    return ImageRootfs(
        image=dest,
        reference=str(pulled.reference),
        digest=pulled.digest,
        platform=pulled.platform,
        config=ImageConfig.from_document(pulled.config),
    )


def _unpack(pulled: PulledImage, tree: Path) -> None:
    for layer, diff_id in zip(pulled.layers, pulled.diff_ids, strict=True):
        apply_layer(tree, pulled.layer_path(layer), diff_id)
    prepare_guest_tree(tree)


def _ext4_size_mib(tree: Path) -> int:
    """Room for the data and for an inode per entry. make_ext4's default size follows the bytes
    alone, at one inode per 8 KiB (its `-i 8192`): images of many small files (node_modules,
    site-packages) would run out of inodes."""
    blocks = entries = 0
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in (*dirnames, *filenames):
            entries += 1
            blocks += os.lstat(os.path.join(dirpath, name)).st_blocks
    need = max(blocks * 512, entries * 8192) * 5 // 4
    return (need >> 20) + 64
