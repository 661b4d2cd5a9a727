"""Layered memory state (`aenv.runtime.ramlayers`) on streams laid out as QEMU 7.2 writes them
(a RAM section whose START holds the block list, PART and END sections of page records, device
sections after): composing a chain, what a save over it keeps, refusing what is cut short.
Real VMs run through the same code in `tests/runtime/qemu_vm/test_ramdelta.py`."""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

import pytest

from aenv.runtime import ramdelta, ramlayers
from aenv.runtime.driver import Snapshot, VMSpec
from aenv.runtime.qemu import QemuConfig, QemuDriver
from aenv.runtime.ramdelta import PAGE

BLOCK = b"mem"
SECTION = 2
DEVICES = b"\x04\x00\x00\x00\x03\x06virtio" + b"device-state" + b"\x00"


def _page(fill: int) -> bytes:
    return bytes([fill]) * PAGE


def stream(pages: dict[int, bytes | None], devices: bytes = DEVICES) -> bytes:
    """A stream with `pages` (None: a zero page) split over a PART and the END section, a
    second RAM block's page among them, and `devices` after."""
    be64 = struct.Struct(">Q").pack
    header = b"QEVM\x00\x00\x00\x03" + b"\x07\x00\x00\x00\x04pc-0"
    start = b"\x01" + SECTION.to_bytes(4, "big") + b"\x03ram" + bytes(4) + (4).to_bytes(4, "big")
    blocks = b"\x03mem" + be64(1 << 30) + be64(0) + b"\x03rom" + be64(PAGE) + be64(0)
    footer = b"\x7e" + SECTION.to_bytes(4, "big")
    eos = be64(0x10)
    out = [header, start, be64((1 << 30) + PAGE | 0x04), blocks, eos, footer]
    records = [
        ramdelta.page_record(page, _page(0)[:1] if data is None else data, None)
        for page, data in sorted(pages.items())
    ]
    half = len(records) // 2
    rom = be64(0x08) + b"\x03rom" + _page(0x77)
    for kind, part in ((b"\x02", records[:half]), (b"\x03", records[half:])):
        out += [kind + SECTION.to_bytes(4, "big")]
        if part:  # each section names its block again, as QEMU does
            first = part[0]
            out += [first[:8], b"\x03mem"]
            out[-2] = be64(struct.unpack(">Q", first[:8])[0] & ~0x20)
            out += [first[8:], *part[1:]]
        out += [rom, eos, footer]
    return b"".join([*out, devices, b"\x00"])


def pages_of(data: bytes) -> dict[int, bytes]:
    index = ramdelta.index_stream(memoryview(data), BLOCK)
    return {
        page: _page(-1 - at) if at < 0 else data[at : at + PAGE] for page, at in index.pages.items()
    }


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _compose(paths: list[Path]) -> bytes:
    read, write = os.pipe()
    got = bytearray()

    def drain() -> None:
        with open(read, "rb") as f:
            got.extend(f.read())

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        ramlayers.compose_into(paths, BLOCK, write)
    finally:
        os.close(write)
        reader.join()
    return bytes(got)


def test_a_chain_composes_into_one_stream_newest_page_first(tmp_path: Path) -> None:
    first = _write(tmp_path / "1", stream({0: _page(1), 1: _page(2), 2: None, 9: _page(9)}))
    second = _write(tmp_path / "2", stream({1: _page(3), 3: _page(4)}, devices=b"\x04second"))
    third = _write(tmp_path / "3", stream({9: None, 4: _page(5)}, devices=b"\x04third"))
    composed = _compose([first, second, third])
    assert pages_of(composed) == {
        0: _page(1),
        1: _page(3),
        2: _page(0),
        3: _page(4),
        4: _page(5),
        9: _page(0),
    }
    # The newest state's device sections, and a stream the filter reads like any other.
    assert composed.endswith(b"\x04third\x00")
    kept, stats = ramdelta.filter_stream(memoryview(composed), BLOCK, {0, 1, 2, 3, 4, 9})
    assert stats.pages_kept == 6 and b"".join(bytes(p) for p in kept) == composed


def test_a_save_over_a_chain_keeps_only_what_differs_from_it(tmp_path: Path) -> None:
    first = _write(tmp_path / "1", stream({0: _page(1), 1: _page(2), 2: None}))
    second = _write(tmp_path / "2", stream({1: _page(3), 3: _page(4)}))
    chain = ramlayers.Chain([first, second], BLOCK)
    try:
        # The VM's next stream: pages 0, 1 and 2 as the chain had them, 3 rewritten, 5 new,
        # and page 2 as a whole page of zeros where the chain had a zero record.
        now = stream({0: _page(1), 1: _page(3), 2: _page(0), 3: _page(8), 5: _page(6)})
        changed = frozenset({3, 5}).union(chain.where)
        kept, stats = ramdelta.filter_stream(memoryview(now), BLOCK, changed, chain.same)
        assert chain.holding_pages() == (first, second)
    finally:
        chain.close()
    saved = b"".join(bytes(p) for p in kept)
    assert stats.pages_kept == 2 and pages_of(saved) == {3: _page(8), 5: _page(6)}
    # Restored as the chain plus the save, every page is what the VM had.
    third = _write(tmp_path / "3", saved)
    assert pages_of(_compose([first, second, third])) == {
        0: _page(1),
        1: _page(3),
        2: _page(0),
        3: _page(8),
        5: _page(6),
    }


def test_states_without_pages_are_no_layers(tmp_path: Path) -> None:
    devices_only = _write(tmp_path / "template", stream({}))
    delta = _write(tmp_path / "delta", stream({1: _page(1)}))
    chain = ramlayers.Chain([devices_only, delta], BLOCK)
    try:
        assert chain.holding_pages() == (delta,)
    finally:
        chain.close()


def test_chains_stop_at_their_depth_and_at_half_the_ram(tmp_path: Path) -> None:
    states = [_write(tmp_path / str(i), stream({i: _page(i)})) for i in range(ramlayers.MAX_DEPTH)]
    roomy = 1 << 30
    assert ramlayers.chain(states[:2], states[2], roomy) == tuple(states[:3])
    assert ramlayers.chain(states[:-1], states[-1], roomy) == ()
    assert ramlayers.chain([], states[0], 2 * PAGE) == ()


def test_a_chain_cut_short_is_refused(tmp_path: Path) -> None:
    whole = stream({0: _page(1), 1: _page(2)})
    first = _write(tmp_path / "1", whole[: len(whole) // 2])
    second = _write(tmp_path / "2", stream({3: _page(3)}))
    with pytest.raises(ramdelta.StreamFormatError, match="ends inside"):
        _compose([first, second])
    with pytest.raises(ramdelta.StreamFormatError, match="not a QEMU migration stream"):
        ramlayers.Chain([_write(tmp_path / "bad", b"nope" + bytes(64))], BLOCK)


def layered(directory: Path, count: int) -> Snapshot:
    """A state over `count` - 1 older ones in `directory`, page i holding fill i + 1 in state
    i and page 0 rewritten by each."""
    states = [
        _write(directory / f"state-{i}", stream({0: _page(100 + i), i + 1: _page(i + 1)}))
        for i in range(count)
    ]
    memory = _write(directory / "memory", b"the memory the states lie over")
    spec = VMSpec(vcpus=1, memory_mib=256, kernel=Path("/k"), cmdline="", workdir=directory)
    return Snapshot(
        driver="qemu",
        compat="x",
        spec=spec,
        state_file=states[-1],
        memory_file=memory,
        disks={},
        layers=tuple(states[:-1]),
    )


async def test_merging_layers_writes_the_chain_as_one_state(tmp_path: Path) -> None:
    snap = layered(tmp_path, 3)
    out = tmp_path / "merged"
    out.mkdir()
    merged = await QemuDriver(QemuConfig(jail=None)).merge_layers(snap, out)
    assert merged.layers == () and merged.state_file == out / "state"
    expected = {0: _page(102), 1: _page(1), 2: _page(2), 3: _page(3)}
    assert pages_of(merged.state_file.read_bytes()) == expected
