"""The QEMU driver's qcow2 layers on real files: overlays, chains, sealing and flattening."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from aenv.runtime import qcow2
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


async def test_a_new_upper_is_raw(tmp_path: Path) -> None:
    upper = await layers.new_upper(tmp_path / "upper.img", 1024)
    assert not qcow2.is_qcow2(upper)


async def test_chain_seal_and_flatten(tmp_path: Path) -> None:
    base = await layers.new_upper(tmp_path / "base.img", 64)
    top = base
    sealed: list[Path] = []
    for depth in range(1, 5):
        nxt = await qcow2.overlay(top, tmp_path / f"l{depth}.qcow2")
        write_at(nxt, depth << 20, bytes([depth]))
        sealed.append(await layers.seal(nxt, tmp_path / f"sealed{depth}.qcow2"))
        top = nxt
    assert qcow2.is_qcow2(top)
    assert len(qcow2.chain(top)) == 5
    info = subprocess.run(
        ["qemu-img", "info", "--backing-chain", "--output=json", "-U", str(top)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert qcow2.chain(top) == [Path(entry["filename"]) for entry in json.loads(info.stdout)]
    last = sealed[-1]
    assert (last.stat().st_mode & 0o222) == 0  # sealed layers are read-only
    assert last.stat().st_ino == top.stat().st_ino  # same filesystem: a hard link, no copy
    assert await qcow2.flatten_if_deep(last, max_depth=8) == last
    assert len(qcow2.chain(last)) == 5
    await qcow2.flatten_if_deep(last, max_depth=2)
    assert len(qcow2.chain(last)) == 1
    assert [read_byte(last, d << 20) for d in range(1, 5)] == [1, 2, 3, 4]


async def test_overlays_over_one_layer_are_copies_of_the_first(tmp_path: Path) -> None:
    base = await layers.new_upper(tmp_path / "base.img", 64)
    first = await qcow2.overlay(base, tmp_path / "a.qcow2")
    second = await qcow2.overlay(base, tmp_path / "b.qcow2")
    assert first.read_bytes() == second.read_bytes()
    for top in (first, second):
        subprocess.run(["qemu-img", "check", "-q", str(top)], check=True)
        assert qcow2.chain(top) == [top, base]
    write_at(second, 5 << 20, b"\x07")  # the copies are independent files
    assert read_byte(first, 5 << 20) == 0 and read_byte(second, 5 << 20) == 7
    # A different layer at the same path (a bigger one here) gets its own overlay.
    base.unlink()
    await layers.new_upper(base, 128)
    third = await qcow2.overlay(base, tmp_path / "c.qcow2")
    info = subprocess.run(
        ["qemu-img", "info", "--output=json", str(third)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(info.stdout)["virtual-size"] == 128 << 20
