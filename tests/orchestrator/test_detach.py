"""Switching a saved directory to its detached (or merged) form, and what a crash at each step
leaves. (Detaching itself, with real VMs, is tested in tests/runtime/qemu_vm and tests/e2e.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from aenv.orchestrator import checkpoints, detach
from aenv.runtime.driver import Snapshot, VMSpec
from aenv.runtime.qemu import QemuConfig, QemuDriver
from aenv.runtime.ramdelta import PAGE
from tests.doubles.slots import DoubleSlots
from tests.runtime.test_ramlayers import layered, pages_of


def _stream_form(directory: Path) -> Snapshot:
    (directory / "state").write_bytes(b"device state and RAM")
    (directory / "upper.qcow2").write_bytes(b"layer")
    spec = VMSpec(vcpus=1, memory_mib=256, kernel=Path("/k"), cmdline="", workdir=directory)
    snap = Snapshot(
        driver="qemu",
        compat="x",
        spec=spec,
        state_file=directory / "state",
        memory_file=None,
        disks={"upper": directory / "upper.qcow2"},
    )
    snap.save_manifest()
    return snap


def _detached_form(directory: Path, stream: Snapshot) -> Snapshot:
    """What `Driver.detach_memory` leaves: state in detached/, memory next to the stream."""
    (directory / detach.DETACHED).mkdir()
    (directory / detach.DETACHED / "state").write_bytes(b"device state")
    (directory / "memory").write_bytes(b"RAM")
    detached = dataclasses.replace(
        stream, state_file=directory / detach.DETACHED / "state", memory_file=directory / "memory"
    )
    detached.save_manifest()
    return detached


@pytest.fixture
def pause(tmp_path: Path) -> Path:
    directory = checkpoints.pause_dir(tmp_path, 1)
    directory.mkdir()
    return directory


def test_adopt_switches_the_manifest_and_frees_the_stream(pause: Path) -> None:
    detached = _detached_form(pause, _stream_form(pause))
    detach.adopt(pause, detached)
    assert Snapshot.load_manifest(pause) == detached
    assert not (pause / "state").exists()
    assert (pause / "upper.qcow2").is_file()  # disks are shared by both forms
    assert checkpoints.latest_pause(pause.parent) == (1, detached)


def test_crash_before_adopt_keeps_the_stream_form(pause: Path) -> None:
    stream = _stream_form(pause)
    _detached_form(pause, stream)
    checkpoints.prune_pauses(pause.parent, 1)  # what a restart does
    assert Snapshot.load_manifest(pause) == stream
    assert sorted(p.name for p in pause.iterdir()) == ["snapshot.json", "state", "upper.qcow2"]


def test_crash_after_adopt_removes_the_old_stream(pause: Path) -> None:
    detached = _detached_form(pause, _stream_form(pause))
    detached.save_manifest(pause)  # the manifest switched, the stream not yet unlinked
    checkpoints.prune_pauses(pause.parent, 1)
    assert Snapshot.load_manifest(pause) == detached
    assert not (pause / "state").exists()
    assert (pause / "memory").is_file() and detached.state_file.is_file()


def test_older_checkpoints_lose_both_forms(tmp_path: Path) -> None:
    old = checkpoints.pause_dir(tmp_path, 1)
    old.mkdir()
    detach.adopt(old, _detached_form(old, _stream_form(old)))
    new = checkpoints.pause_dir(tmp_path, 2)
    new.mkdir()
    _stream_form(new)
    checkpoints.prune_pauses(tmp_path, 2)
    assert sorted(p.name for p in old.iterdir()) == ["upper.qcow2"]  # layers stay below newer
    assert checkpoints.latest_pause(tmp_path) == (2, Snapshot.load_manifest(new))


def test_discard_leaves_the_stream_form(pause: Path) -> None:
    stream = _stream_form(pause)
    _detached_form(pause, stream)
    detach.discard(pause)
    assert Snapshot.load_manifest(pause) == stream
    assert not (pause / "memory").exists()
    assert not (pause / detach.DETACHED).exists()


def test_older_checkpoints_of_any_driver_lose_state_and_memory(tmp_path: Path) -> None:
    """The files a checkpoint's manifest names are freed, whatever the driver called them
    (Firecracker's pair is `vmstate.bin` and `memory-<n>.bin`)."""
    old = checkpoints.pause_dir(tmp_path, 1)
    old.mkdir()
    for name in ("vmstate.bin", "memory-1.bin", "disk-upper.img"):
        (old / name).write_bytes(name.encode())
    spec = VMSpec(vcpus=1, memory_mib=256, kernel=Path("/k"), cmdline="", workdir=old)
    Snapshot(
        driver="firecracker",
        compat="x",
        spec=spec,
        state_file=old / "vmstate.bin",
        memory_file=old / "memory-1.bin",
        disks={"upper": old / "disk-upper.img"},
    ).save_manifest()
    new = checkpoints.pause_dir(tmp_path, 2)
    new.mkdir()
    _stream_form(new)
    checkpoints.prune_pauses(tmp_path, 2)
    assert sorted(p.name for p in old.iterdir()) == ["disk-upper.img"]


def test_pruning_keeps_the_memory_a_newer_checkpoint_lies_over(tmp_path: Path) -> None:
    """A checkpoint that saved only changed pages names the memory file it was restored from
    (an older checkpoint's): freeing the older one must leave that file."""
    old = checkpoints.pause_dir(tmp_path, 1)
    old.mkdir()
    base = _detached_form(old, _stream_form(old))
    detach.adopt(old, base)
    new = checkpoints.pause_dir(tmp_path, 2)
    new.mkdir()
    (new / "state").write_bytes(b"device state and changed pages")
    delta = dataclasses.replace(base, state_file=new / "state", disks={})
    delta.save_manifest(new)
    checkpoints.prune_pauses(tmp_path, 2)
    assert (old / "memory").is_file() and not base.state_file.exists()
    assert checkpoints.latest_pause(tmp_path) == (2, delta)
    checkpoints.prune_pauses(tmp_path, 2)  # again, as after a restart: still there
    assert (old / "memory").is_file()
    # Once no newer checkpoint lies over it, the older one goes but for its disk layers.
    newer = checkpoints.pause_dir(tmp_path, 3)
    newer.mkdir()
    _stream_form(newer)
    checkpoints.prune_pauses(tmp_path, 3)
    assert sorted(p.name for p in old.iterdir()) == ["upper.qcow2"]


def _layered(directory: Path, below: tuple[Path, ...]) -> Snapshot:
    """A state of changed pages over a template's memory file and the older states `below`."""
    (directory / "state").write_bytes(b"device state and pages changed since " + bytes(len(below)))
    memory = directory.parent / "template-memory"
    memory.write_bytes(b"the template's memory")
    spec = VMSpec(vcpus=1, memory_mib=256, kernel=Path("/k"), cmdline="", workdir=directory)
    snap = Snapshot(
        driver="qemu",
        compat="x",
        spec=spec,
        state_file=directory / "state",
        memory_file=memory,
        disks={},
        layers=below,
    )
    snap.save_manifest()
    return snap


def _pauses(tmp_path: Path, count: int) -> list[Snapshot]:
    """`count` pauses, each a layer over all the ones before, pruned as pauses are."""
    saved: list[Snapshot] = []
    for seq in range(1, count + 1):
        directory = checkpoints.pause_dir(tmp_path, seq)
        directory.mkdir()
        below = (*saved[-1].layers, saved[-1].state_file) if saved else ()
        saved.append(_layered(directory, below))
        checkpoints.prune_pauses(tmp_path, seq)
    return saved


def test_pruning_keeps_the_states_a_newer_checkpoint_lies_over(tmp_path: Path) -> None:
    saved = _pauses(tmp_path, 3)
    assert all(s.state_file.is_file() for s in saved)
    assert checkpoints.latest_pause(tmp_path) == (3, saved[-1])


def test_a_merged_chain_frees_the_states_below_it_at_the_next_prune(tmp_path: Path) -> None:
    saved = _pauses(tmp_path, 3)
    top = checkpoints.pause_dir(tmp_path, 3)
    (top / detach.DETACHED).mkdir()
    (top / detach.DETACHED / "state").write_bytes(b"the three states as one")
    merged = dataclasses.replace(saved[-1], state_file=top / detach.DETACHED / "state", layers=())
    detach.adopt(top, merged)
    assert not saved[-1].state_file.exists()
    checkpoints.prune_pauses(tmp_path, 3)  # what the next pause or a restart does
    assert not saved[0].state_file.exists() and not saved[1].state_file.exists()
    assert checkpoints.latest_pause(tmp_path) == (3, merged)
    # A pause over the merged state keeps it; the one after frees it.
    fourth = checkpoints.pause_dir(tmp_path, 4)
    fourth.mkdir()
    _layered(fourth, (merged.state_file,))
    checkpoints.prune_pauses(tmp_path, 4)
    assert merged.state_file.is_file()
    fifth = checkpoints.pause_dir(tmp_path, 5)
    fifth.mkdir()
    _layered(fifth, ())
    checkpoints.prune_pauses(tmp_path, 5)
    assert not merged.state_file.exists() and not (top / "snapshot.json").exists()


def test_a_crash_during_a_merge_keeps_the_layered_form(tmp_path: Path) -> None:
    saved = _pauses(tmp_path, 3)
    top = checkpoints.pause_dir(tmp_path, 3)
    (top / detach.DETACHED).mkdir()
    (top / detach.DETACHED / "state").write_bytes(b"half of the merged stat")  # cut here
    checkpoints.prune_pauses(tmp_path, 3)  # the restart
    assert Snapshot.load_manifest(top) == saved[-1]
    assert not (top / detach.DETACHED).exists()
    assert all(s.state_file.is_file() for s in saved)


async def test_a_deep_chain_is_merged_and_adopted_as_one_state(tmp_path: Path) -> None:
    """`Detacher.merge` with the QEMU driver's merge of real stream layouts: the merged form
    is written beside the layered one, adopted like a detached form, and its pages are the
    chain's, newest first."""
    directory = checkpoints.pause_dir(tmp_path, 1)
    directory.mkdir()
    snap = layered(directory, detach.MERGE_DEPTH + 1)
    snap.save_manifest()
    detacher = detach.Detacher(
        QemuDriver(QemuConfig(jail=None)), DoubleSlots(), tmp_path / "w", tmp_path / "m"
    )
    assert (
        await detacher.merge(dataclasses.replace(snap, layers=snap.layers[1:]), directory) is None
    )
    merged = await detacher.merge(snap, directory)
    assert merged is not None and merged.state_file.parent == directory / detach.DETACHED
    assert Snapshot.load_manifest(directory) == snap  # not adopted yet
    detach.adopt(directory, merged)
    assert Snapshot.load_manifest(directory) == merged and not snap.state_file.exists()
    assert pages_of(merged.state_file.read_bytes()) == {
        0: bytes([100 + detach.MERGE_DEPTH]) * PAGE,
        **{i + 1: bytes([i + 1]) * PAGE for i in range(detach.MERGE_DEPTH + 1)},
    }


async def test_a_fork_checkpoint_in_layers_is_merged_before_its_children_restore(
    tmp_path: Path,
) -> None:
    """`detach_in_place` (fork checkpoints): a state in layers, of any depth, is merged and
    adopted at once, so the children load one state rather than each composing the chain."""
    parent, directory = tmp_path / "parent", tmp_path / "fork"
    parent.mkdir()
    directory.mkdir()
    chain = layered(parent, 2)  # the parent's older state stays where it is
    top = directory / "state"
    chain.state_file.rename(top)
    snap = dataclasses.replace(
        chain, state_file=top, spec=dataclasses.replace(chain.spec, workdir=directory)
    )
    snap.save_manifest(directory)
    detacher = detach.Detacher(
        QemuDriver(QemuConfig(jail=None)), DoubleSlots(), tmp_path / "w", tmp_path / "m"
    )
    merged = await detacher.detach_in_place(snap, directory)
    assert merged.layers == () and Snapshot.load_manifest(directory) == merged
    assert not snap.state_file.exists() and all(p.is_file() for p in snap.layers)
    expected = {0: bytes([101]) * PAGE, 1: bytes([1]) * PAGE, 2: bytes([2]) * PAGE}
    assert pages_of(merged.state_file.read_bytes()) == expected
