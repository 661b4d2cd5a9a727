"""Pauses of restored VMs save only the memory the guest changed (`aenv.runtime.ramdelta`), on
real VMs: chains of pause and restore in several orders, a live process across 100 cycles, a
clone whose guest writes most of its RAM (its VMM's memory cap), and the stream filter's refusal
of what it does not know."""

from __future__ import annotations

import itertools
import json
import os
import statistics
import threading
from pathlib import Path
from typing import Any

import pytest

from aenv.config import Config
from aenv.orchestrator.repository import open_archive
from aenv.runtime import ramdelta
from aenv.runtime.driver import Snapshot
from aenv.runtime.qemu import QemuDriver, QemuVM
from tests.runtime.qemu_vm.conftest import (
    TEMPLATE_MEMORY,
    Fleet,
    Images,
    Places,
    Template,
    boot_template,
)
from tests.runtime.qemu_vm.netns import NetnsPool, agent, wait_ready

MIB = 1 << 20
ROOMY_MIB = 512
# Most of the roomy guest's RAM: pages its template never touched, so holes in the base file.
FILL_MIB = 320
WRITE_MIB = 24  # what a clone writes before a snapshot: 1/10 of the test guest's RAM


def _size(path: Path) -> int:
    return path.stat().st_blocks * 512


async def test_pause_of_a_clone_writes_what_changed(
    fleet: Fleet, template: Template, places: Places
) -> None:
    vm, netns = await fleet.restore(template.snapshot)
    await agent(netns, "POST", "/?memory=changed&note=changed-note")
    assert isinstance(vm, QemuVM)
    base = vm.memory.path
    snap = await vm.snapshot(places.snapshot_target(), keep_running=False)
    # The clone's memory file stays its base; the stream holds device state and a few MiB.
    assert snap.memory_file == base == template.snapshot.memory_file
    assert 0 < _size(snap.state_file) < 16 * MIB
    clone, clone_netns = await fleet.restore(snap)
    state = await agent(clone_netns)
    assert (state["memory"], state["note"]) == ("changed", "changed-note")
    # The template's own clones still see the template: the base file was not written.
    other, other_netns = await fleet.restore(template.snapshot)
    assert (await agent(other_netns))["memory"] == TEMPLATE_MEMORY
    await other.stop()
    await clone.stop()


async def test_a_snapshot_of_a_running_clone_writes_what_changed(
    fleet: Fleet, template: Template, places: Places
) -> None:
    """A snapshot that keeps the clone running (what snapshots and fork checkpoints do) writes
    the pages the guest changed, however much RAM it had touched since its base: after the
    guest writes 24 MiB, the state grows by those 24 MiB (and little more) and its memory
    file is the base's own bytes, linked. Four clones of it and the source all go on."""
    vm, netns = await fleet.restore(template.snapshot)
    await agent(netns, "POST", "/?memory=snapped&note=snapped-note")
    assert isinstance(vm, QemuVM)
    idle = await vm.snapshot(places.snapshot_target(), keep_running=True)
    assert idle.memory_file is not None and template.snapshot.memory_file is not None
    assert idle.memory_file.stat().st_ino == template.snapshot.memory_file.stat().st_ino
    idle_bytes = _size(idle.state_file)
    assert 0 < idle_bytes < 16 * MIB
    fill = f"yes 0123456789abcdef | head -c {WRITE_MIB}M > /dev/shm/w && wc -c < /dev/shm/w"
    assert (await _sh(netns, fill))["stdout"].strip() == str(WRITE_MIB * MIB)
    wrote = await vm.snapshot(places.snapshot_target(), keep_running=True)
    grown = _size(wrote.state_file) - idle_bytes
    assert WRITE_MIB * MIB <= grown < (WRITE_MIB + 8) * MIB, grown
    assert (await agent(netns))["memory"] == "snapped"  # the source runs on
    for _, clone_netns in await fleet.restore_many(wrote, 4):
        state = await agent(clone_netns)
        assert (state["memory"], state["note"]) == ("snapped", "snapped-note")
        check = await _sh(clone_netns, "wc -c < /dev/shm/w")
        assert check["stdout"].strip() == str(WRITE_MIB * MIB)


async def test_a_changed_pages_pause_restores_from_the_repository(
    fleet: Fleet, template: Template, places: Places, tmp_path: Path
) -> None:
    """What a node with an empty cache does: the checkpoint comes back from the repository, its
    base memory file with it, into the directory it was exported to, and restores there."""
    vm, netns = await fleet.restore(template.snapshot)
    await agent(netns, "POST", "/?memory=archived&note=archived-note")
    paused = await vm.snapshot(places.snapshot_target(), keep_running=False)
    archive = open_archive(Config(home=tmp_path / "home"))
    assert archive is not None
    try:
        manifest = await archive.push_checkpoint(
            paused, tmp_path / "staging", fleet.driver, name="pause", metadata={}
        )
        pulled = await archive.pull(manifest, tmp_path / "staging", fleet.driver)
    finally:
        archive.close()
    assert pulled.memory_file == tmp_path / "staging" / "memory"
    assert pulled.state_file.read_bytes() == paused.state_file.read_bytes()
    restored, restored_netns = await fleet.restore(pulled)
    state = await agent(restored_netns)
    assert (state["memory"], state["note"]) == ("archived", "archived-note")
    await restored.stop()


async def test_chains_of_pause_restore_and_full_saves(
    fleet: Fleet, template: Template, places: Places
) -> None:
    """pause -> restore -> pause (a delta over the same base file, layered on the first) -> snapshot
    of the restored VM, kept running (a delta over a link to the base) -> its clone paused
    again over that link."""
    vm, netns = await fleet.restore(template.snapshot)
    await agent(netns, "POST", "/?memory=one&note=one")
    first = await vm.snapshot(places.snapshot_target(), keep_running=False)
    vm, netns = await fleet.restore(first)
    assert (await agent(netns))["memory"] == "one"
    await agent(netns, "POST", "/?memory=two&note=two")
    second = await vm.snapshot(places.snapshot_target(), keep_running=False)
    assert second.memory_file == first.memory_file  # the base file stays the base
    vm, netns = await fleet.restore(second)
    assert (await agent(netns))["memory"] == "two"
    full = await vm.snapshot(places.snapshot_target(), keep_running=True)
    assert full.memory_file is not None and first.memory_file is not None
    assert vm.state.value == "running"
    assert full.memory_file.stat().st_ino == first.memory_file.stat().st_ino
    await agent(netns, "POST", "/?memory=three&note=three")
    third = await vm.snapshot(places.snapshot_target(), keep_running=False)
    vm, netns = await fleet.restore(third)
    assert (await agent(netns))["memory"] == "three"
    await vm.stop()
    # The snapshot's clone maps the link; its pause is a delta over the link.
    child, child_netns = await fleet.restore(full)
    assert (await agent(child_netns))["memory"] == "two"
    own = await child.snapshot(places.snapshot_target(), keep_running=False)
    assert own.memory_file == full.memory_file
    grandchild, gc_netns = await fleet.restore(own)
    assert (await agent(gc_netns))["memory"] == "two"
    await grandchild.stop()
    # The first save showed the filter this QEMU's streams: the later ones went through a pipe.
    assert fleet.driver.streams_understood


async def test_a_hundred_cycles_keep_a_live_process_and_do_not_grow(
    fleet: Fleet, template: Template, places: Places
) -> None:
    vm, netns = await fleet.restore(template.snapshot)
    pid = (await _sh(netns, "sleep 100000 >/dev/null 2>&1 & echo $!"))["stdout"].strip()
    sizes: list[int] = []
    kept: set[Path] = set()
    for cycle in range(100):
        await agent(netns, "POST", f"/?memory=cycle-{cycle}&note=n")
        snap = await vm.snapshot(places.snapshot_target(), keep_running=False)
        sizes.append(_size(snap.state_file))
        vm, netns = await fleet.restore(snap)
        state = await agent(netns)
        assert state["memory"] == f"cycle-{cycle}"
        alive = await _sh(netns, f"kill -0 {pid} && echo alive")
        assert alive["stdout"].strip() == "alive", f"cycle {cycle}: the process is gone"
        # What the next pause frees: states the newest does not lie over (disk layers stay).
        for old in kept - {*snap.layers}:
            old.unlink()
        kept = {*snap.layers, snap.state_file}
    # Each save is a layer of what changed since the one before, and every few saves one
    # against the base starts a new chain (`ramlayers.MAX_DEPTH`): no growth.
    layered = [size for size in sizes[1:] if size < sizes[0]]
    assert len(layered) >= len(sizes) // 2, sizes
    assert max(sizes[10:]) < 2 * max(sizes[:10]) + 4 * MIB, sizes
    assert statistics.median(sizes[-10:]) < 1.5 * statistics.median(sizes[1:11]) + MIB, sizes
    await vm.stop()


@pytest.fixture(scope="module")
async def roomy_template(
    driver: QemuDriver, images: Images, places: Places, nets: NetnsPool
) -> Snapshot:
    """A template whose guest has far more RAM than it touched while booting: its memory file
    is mostly holes, as a real `base` template's is."""
    vm, netns = await boot_template(driver, images, places, nets, memory_mib=ROOMY_MIB)
    try:
        await wait_ready(netns)
        return await vm.snapshot(places.snapshot_target(), keep_running=False)
    finally:
        await vm.stop()


async def test_a_resumed_clone_whose_guest_writes_most_of_its_memory_keeps_running(
    fleet: Fleet, roomy_template: Snapshot, places: Places
) -> None:
    """What killed VMMs (issue 18): a clone maps its base file privately, and each page the guest
    writes where that file has a hole costs the VMM's cgroup a page of the file (tmpfs fills the
    hole, unreclaimable) besides its private copy. Restore, pause (changed pages), restore that
    pause, then the guest fills most of its RAM: the VMM must keep running, and so must it
    through a pause of all that and a restore of the pause."""
    vm, _ = await fleet.restore(roomy_template)
    paused = await vm.snapshot(places.snapshot_target(), keep_running=False)
    vm, netns = await fleet.restore(paused)
    fill = (
        f"mount -o remount,size=90% /dev/shm && yes 0123456789abcdef | head -c {FILL_MIB}M "
        "> /dev/shm/fill && wc -c < /dev/shm/fill"
    )
    done = await _sh(netns, fill, limit_s=300)
    assert (done["rc"], done["stdout"].strip()) == (0, str(FILL_MIB * MIB)), done
    assert vm.state.value == "running"
    again = await vm.snapshot(places.snapshot_target(), keep_running=False)
    assert _size(again.state_file) > FILL_MIB * MIB
    vm, netns = await fleet.restore(again)
    # The file's size and its last MiB (the pages the guest wrote last) came back.
    check = "wc -c < /dev/shm/fill; tail -c 1M /dev/shm/fill | tr -d '\\n0-9a-f' | wc -c"
    assert (await _sh(netns, check))["stdout"].split() == [str(FILL_MIB * MIB), "0"]
    await vm.stop()


async def test_the_pipe_filter_keeps_what_the_file_filter_keeps(
    fleet: Fleet, template: Template, places: Places, tmp_path: Path
) -> None:
    """One real stream filtered from a file at once and from a pipe fed in odd pieces (so that
    reads end inside headers, records and pages) gives the same bytes; cut short, it is
    refused."""
    vm, netns = await fleet.restore(template.snapshot)
    await agent(netns, "POST", "/?memory=piped&note=piped-note")
    assert isinstance(vm, QemuVM)
    await vm.pause()
    keep = ramdelta.changed_pages(vm.proc.pid, vm.memory.path)
    stream = places.shm / "stream"
    await vm.save_state(stream, ignore_shared=True)
    await vm.stop()
    whole = ramdelta.filter_file(stream, tmp_path / "whole", "mem", keep)
    read, write = os.pipe()

    def feed() -> None:
        sizes = itertools.cycle((1, 7, 4099, 9, 65536, 12345, 4105))
        with open(stream, "rb") as f, open(write, "wb", buffering=0) as out:
            while chunk := f.read(next(sizes)):
                out.write(chunk)

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        piped = ramdelta.filter_pipe(read, tmp_path / "piped", "mem", keep)
    finally:
        feeder.join()
        os.close(read)
    assert (tmp_path / "piped").read_bytes() == (tmp_path / "whole").read_bytes()
    assert piped == whole and whole.pages_kept > 0
    data = stream.read_bytes()
    with pytest.raises(ramdelta.StreamFormatError, match="ends inside its records"):
        ramdelta.filter_stream(memoryview(data[: len(data) // 2]), b"mem", keep)


def test_filter_refuses_what_it_does_not_know(tmp_path: Path) -> None:
    with pytest.raises(ramdelta.StreamFormatError, match="not a QEMU migration stream"):
        ramdelta.filter_stream(memoryview(b"nope" + bytes(64)), b"mem", set())
    header = b"QEVM\x00\x00\x00\x03\x07"
    with pytest.raises(ramdelta.StreamFormatError, match="no RAM section"):
        ramdelta.filter_stream(memoryview(header + bytes(64)), b"mem", set())
    ram = b"\x01\x00\x00\x00\x02\x03ram\x00\x00\x00\x00\x00\x00\x00\x04"
    bad_flags = (0x4000 | 0x40).to_bytes(8, "big")  # XBZRLE: not produced by our saves
    with pytest.raises(ramdelta.StreamFormatError, match="flags 0x40"):
        ramdelta.filter_stream(memoryview(header + ram + bad_flags + bytes(8)), b"mem", set())


def test_changed_pages_needs_the_mapping(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not map"):
        ramdelta.changed_pages(os.getpid(), tmp_path / "absent")


async def _sh(netns: str, script: str, limit_s: float = 30.0) -> Any:
    body = json.dumps({"argv": ["sh", "-c", script], "timeout": limit_s}).encode()
    return await agent(netns, "POST", "/run", body=body, limit_s=limit_s + 5)
