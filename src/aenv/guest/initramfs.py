"""The initramfs: busybox-static, our PID 1 (`aenv.guest.pid1`), the kernel modules our init
needs (dependencies first), and our init scripts.

Module dependencies come from each module's `.modinfo` section (the Debian package ships no
modules.dep, and the host may have no kmod), so the load order is computed, not hand-listed:
e.g. `virtio_ring` must precede `virtio` or insmod fails with unknown symbols.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import shlex
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from elftools.elf.elffile import ELFFile

from aenv.guest import pid1
from aenv.guest.cache import cached_dir
from aenv.guest.init_script import STAGE1, STAGE2
from aenv.guest.kernel import Kernel
from aenv.guest.proc import BuildError, run

BUSYBOX = Path("/bin/busybox")
# What our init mounts and talks through. crc32c_generic is a soft dependency of ext4 (checksums are
# looked up through the crypto API at mount time, which cannot modprobe without modules.dep).
# virtio_balloon and virtio_rng (the Debian file is virtio-rng.ko) drive Firecracker's balloon
# (free page reporting, memory statistics) and entropy devices; nothing else would load them, and
# without a device (QEMU) they load and stay idle. virtio_mmio is a module in the Debian kernel and
# finds Firecracker's devices only through ACPI (see aenv.runtime.firecracker.driver).
# 9pnet_virtio and 9p mount volumes (QEMU's virtio-9p devices; envd mounts them at /init).
MODULES = (
    "virtio_mmio",
    "virtio_blk",
    "virtio_net",
    "virtio_balloon",
    "virtio_rng",
    "crc32c_generic",
    "ext4",
    "overlay",
    "9pnet_virtio",
    "9p",
)


async def build_initramfs(
    kernel: Kernel,
    cache: Path,
    busybox: Path = BUSYBOX,
    modules: Iterable[str] = MODULES,
) -> Path:
    """Return an `initrd.cpio.gz` for `kernel` cached in `cache` (rebuilt when any input
    changes)."""
    wanted = tuple(modules)
    bb_hash = await asyncio.to_thread(_sha256, busybox)
    inputs = {
        "kernel": kernel.version,
        "modules": wanted,
        "busybox": bb_hash,
        "pid1": [pid1.source_hash(), await pid1.compiler_version()],
        "init": hashlib.sha256((STAGE1 + STAGE2).encode()).hexdigest(),
    }

    async def build(tmp: Path) -> None:
        stage = tmp / "stage"
        init = await pid1.build_pid1(tmp)
        order = await asyncio.to_thread(_stage_tree, stage, kernel, busybox, init, wanted)
        init.unlink()
        raw = tmp / "initrd.cpio"
        # Sorted names make the archive reproducible; -R 0:0 makes everything root's.
        out = shlex.quote(str(raw))
        script = f"find . | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet > {out}"
        await run("sh", "-c", script, cwd=stage)
        await asyncio.to_thread(_gzip, raw, tmp / "initrd.cpio.gz")
        raw.unlink()
        await asyncio.to_thread(shutil.rmtree, stage)
        (tmp / "modules.order").write_text("\n".join(order) + "\n")

    entry = await cached_dir("initramfs", inputs, build, cache)
    return entry / "initrd.cpio.gz"


def module_order(deps: Mapping[str, tuple[str, ...]], wanted: Iterable[str]) -> list[str]:
    """Depth-first topological order: every module after all modules it depends on."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise BuildError(f"module dependency cycle through {name}")
        visiting.add(name)
        for dep in deps[name]:
            visit(dep)
        visiting.discard(name)
        order.append(name)

    for name in wanted:
        visit(name)
    return order


def _stage_tree(
    stage: Path, kernel: Kernel, busybox: Path, init: Path, wanted: tuple[str, ...]
) -> list[str]:
    index = {p.name.removesuffix(".ko"): p for p in kernel.modules.rglob("*.ko")}
    deps: dict[str, tuple[str, ...]] = {}
    pending = list(wanted)
    while pending:
        name = pending.pop()
        if name in deps:
            continue
        path = index.get(name) or index.get(name.replace("_", "-"))
        if path is None:
            raise BuildError(f"kernel {kernel.version} has no module {name}")
        deps[name] = _depends(path)
        pending.extend(deps[name])
    order = module_order(deps, wanted)
    for sub in ("bin", "dev", "proc", "sys", "modules"):
        (stage / sub).mkdir(parents=True)
    shutil.copy2(busybox, stage / "bin" / "busybox")
    shutil.copy2(init, stage / "bin" / pid1.NAME)
    for name in order:
        src = index.get(name) or index[name.replace("_", "-")]
        shutil.copy2(src, stage / "modules" / src.name)
    files = [(index.get(n) or index[n.replace("_", "-")]).name for n in order]
    (stage / "modules.order").write_text("\n".join(files) + "\n")
    (stage / "init").write_text(STAGE1)
    (stage / "init").chmod(0o755)
    (stage / "stage2").write_text(STAGE2)
    return files


def _depends(module: Path) -> tuple[str, ...]:
    with module.open("rb") as fh:
        section = ELFFile(fh).get_section_by_name(".modinfo")
        data = section.data() if section is not None else b""
    for entry in data.split(b"\0"):
        key, _, value = entry.partition(b"=")
        if key == b"depends":
            return tuple(v for v in value.decode().split(",") if v)
    return ()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _gzip(src: Path, dst: Path) -> None:
    with src.open("rb") as fin, gzip.open(dst, "wb", compresslevel=6) as fout:
        shutil.copyfileobj(fin, fout)
