"""Root filesystems: the default template's Debian tree (debootstrap, cached) and ext4 images
made from a directory without mounting anything (`mkfs.ext4 -d`)."""

from __future__ import annotations

import asyncio
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from aenv.guest.cache import cached_dir
from aenv.guest.cmdline import ROOT_LABEL
from aenv.guest.proc import run

BASE_PACKAGES = ("bash", "python3", "git", "sudo", "curl", "iproute2", "ca-certificates", "procps")
USER = "user"
UID = 1000


@dataclass(frozen=True)
class BaseRootfs:
    tree: Path
    image: Path  # ext4, label aenv-root


async def build_base_rootfs(
    cache: Path,
    mirror: str,
    suite: str = "bookworm",
    packages: tuple[str, ...] = BASE_PACKAGES,
) -> BaseRootfs:
    """Debian `minbase` + `packages` from `mirror`, user `user` (uid 1000, passwordless sudo);
    built once per set of inputs and reused from `cache` afterwards."""
    inputs = {"suite": suite, "packages": sorted(packages), "mirror": mirror, "recipe": 2}

    async def build(tmp: Path) -> None:
        tree = tmp / "tree"
        await run(
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(sorted(packages))}",
            suite,
            tree,
            mirror,
        )
        await run("chroot", tree, "useradd", "-m", "-u", str(UID), "-s", "/bin/bash", USER)
        sudoers = tree / "etc" / "sudoers.d" / USER
        sudoers.write_text(f"{USER} ALL=(ALL) NOPASSWD:ALL\n")
        sudoers.chmod(0o440)
        (tree / "etc" / "hostname").write_text("sandbox\n")
        (tree / "etc" / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")
        # debootstrap copies the build host's resolver; guests get theirs from `aenv.dns`.
        (tree / "etc" / "resolv.conf").write_text("")
        await asyncio.to_thread(_drop_caches, tree)
        await make_ext4(tree, tmp / "rootfs.ext4", label=ROOT_LABEL, read_only=True)

    entry = await cached_dir("rootfs", inputs, build, cache)
    return BaseRootfs(tree=entry / "tree", image=entry / "rootfs.ext4")


async def make_ext4(
    source: Path | None,
    image: Path,
    *,
    label: str,
    size_mib: int | None = None,
    read_only: bool = False,
) -> Path:
    """Create an ext4 image holding `source` (or empty). Size defaults to the tree plus headroom.
    Read-only images drop the journal and reserved blocks: nothing will ever write them."""
    if size_mib is None:
        used = await asyncio.to_thread(_tree_bytes, source) if source else 0
        size_mib = max(16, int(used * 1.25) // (1 << 20) + 64)
    args: list[str | Path] = ["mkfs.ext4", "-q", "-F", "-L", label, "-i", "8192"]
    if read_only:
        args += ["-O", "^has_journal", "-m", "0"]
    if source is not None:
        args += ["-d", source]
    args += [image, f"{size_mib}M"]
    await run(*args)
    return image


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += (Path(dirpath) / name).lstat().st_blocks * 512
            except OSError:
                continue
    return total


def _drop_caches(tree: Path) -> None:
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for item in (tree / sub).glob("*"):
            if item.is_file():
                item.unlink()
    shutil.rmtree(tree / "var" / "cache" / "apt" / "archives" / "partial", ignore_errors=True)
