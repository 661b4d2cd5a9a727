"""Disk layers on real files: writable uppers, qcow2 chains, sealing and flattening."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from aenv.guest.cmdline import UPPER_LABEL
from aenv.storage import layers


def write_at(image: Path, offset: int, data: bytes) -> None:
    subprocess.run(
        ["qemu-io", "-f", "qcow2", "-c", f"write -P {data[0]} {offset} {len(data)}", str(image)],
        check=True, capture_output=True,
    )  # fmt: skip


def read_byte(image: Path, offset: int) -> int:
    raw = image.with_suffix(".raw")
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(image), str(raw)], check=True)
    with raw.open("rb") as fh:
        fh.seek(offset)
        value = fh.read(1)[0]
    raw.unlink()
    return value


async def test_new_upper_is_sparse_ext4(tmp_path: Path) -> None:
    upper = await layers.new_upper(tmp_path / "upper.img", 1024)
    assert upper.stat().st_size == 1024 << 20
    assert layers.allocated_bytes(upper) < 64 << 20
    label = subprocess.run(["e2label", str(upper)], capture_output=True, text=True, check=True)
    assert label.stdout.strip() == UPPER_LABEL
    assert not layers.is_qcow2(upper)


async def test_chain_seal_and_flatten(tmp_path: Path) -> None:
    base = await layers.new_upper(tmp_path / "base.img", 64)
    top = base
    sealed: list[Path] = []
    for depth in range(1, 5):
        nxt = await layers.qcow2_overlay(top, tmp_path / f"l{depth}.qcow2")
        write_at(nxt, depth << 20, bytes([depth]))
        sealed.append(await layers.seal(nxt, tmp_path / f"sealed{depth}.qcow2"))
        top = nxt
    assert layers.is_qcow2(top)
    assert len(layers.chain(top)) == 5
    info = subprocess.run(
        ["qemu-img", "info", "--backing-chain", "--output=json", "-U", str(top)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert layers.chain(top) == [Path(entry["filename"]) for entry in json.loads(info.stdout)]
    last = sealed[-1]
    assert (last.stat().st_mode & 0o222) == 0  # sealed layers are read-only
    assert last.stat().st_ino == top.stat().st_ino  # same filesystem: a hard link, no copy
    assert await layers.flatten_if_deep(last, max_depth=8) == last
    assert len(layers.chain(last)) == 5
    await layers.flatten_if_deep(last, max_depth=2)
    assert len(layers.chain(last)) == 1
    assert [read_byte(last, d << 20) for d in range(1, 5)] == [1, 2, 3, 4]


async def test_raw_copy_for_vmms_without_cow(tmp_path: Path) -> None:
    upper = await layers.new_upper(tmp_path / "upper.img", 256)
    copy = await layers.sparse_copy(upper, tmp_path / "copy.img")
    assert copy.read_bytes() == upper.read_bytes()
    assert layers.allocated_bytes(copy) <= layers.allocated_bytes(upper) + (1 << 20)


async def test_overlays_over_one_layer_are_copies_of_the_first(tmp_path: Path) -> None:
    base = await layers.new_upper(tmp_path / "base.img", 64)
    first = await layers.qcow2_overlay(base, tmp_path / "a.qcow2")
    second = await layers.qcow2_overlay(base, tmp_path / "b.qcow2")
    assert first.read_bytes() == second.read_bytes()
    for top in (first, second):
        subprocess.run(["qemu-img", "check", "-q", str(top)], check=True)
        assert layers.chain(top) == [top, base]
    write_at(second, 5 << 20, b"\x07")  # the copies are independent files
    assert read_byte(first, 5 << 20) == 0 and read_byte(second, 5 << 20) == 7
    # A different layer at the same path (a bigger one here) gets its own overlay.
    base.unlink()
    await layers.new_upper(base, 128)
    third = await layers.qcow2_overlay(base, tmp_path / "c.qcow2")
    info = subprocess.run(
        ["qemu-img", "info", "--output=json", str(third)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(info.stdout)["virtual-size"] == 128 << 20
