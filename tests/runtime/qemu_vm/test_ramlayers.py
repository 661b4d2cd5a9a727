"""Memory layers on real VMs (`aenv.runtime.ramlayers`): saves of a VM restored from a chain keep
only what changed since it, across pauses, snapshots of a running VM and clones in several
orders, with a live process and the guest's memory intact at every restore; the chain merged
into one state; a layered pause through the repository onto a node with an empty cache; a VMM
killed during a layered save."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from aenv.config import Config
from aenv.orchestrator.repository import open_archive
from aenv.runtime.driver import DriverError, Snapshot
from aenv.runtime.qemu import QemuVM
from tests.runtime.qemu_vm.conftest import Fleet, Places, Template
from tests.runtime.qemu_vm.netns import agent

MIB = 1 << 20


def _size(path: Path) -> int:
    return path.stat().st_size


async def _sh(netns: str, script: str) -> str:
    body = json.dumps({"argv": ["sh", "-c", script], "timeout": 30}).encode()
    result: Any = await agent(netns, "POST", "/run", body=body, limit_s=35)
    return str(result["stdout"]).strip()


async def _check(netns: str, memory: str, pid: str) -> None:
    assert (await agent(netns))["memory"] == memory
    assert await _sh(netns, f"kill -0 {pid} && echo alive") == "alive"


async def _save(vm: Any, places: Places, memory: str, netns: str, *, keep: bool) -> Snapshot:
    await agent(netns, "POST", f"/?memory={memory}&note={memory}")
    snap: Snapshot = await vm.snapshot(places.snapshot_target(), keep_running=keep)
    return snap


async def test_layer_chains_across_pauses_snapshots_and_clones(
    fleet: Fleet, template: Template, places: Places
) -> None:
    """template → pause 1 (over the base) → pause 2 (a layer over 1) → a snapshot of the
    running VM (over 1 and 2) and a pause of it (the same), two clones of the snapshot and a
    clone's pause (over 1, 2 and the snapshot), then the last chain merged into one state.
    Each restore finds the memory it was saved with and the process started first."""
    vm, netns = await fleet.restore(template.snapshot)
    pid = await _sh(netns, "sleep 100000 >/dev/null 2>&1 & echo $!")
    first = await _save(vm, places, "one", netns, keep=False)
    assert first.layers == ()  # the template's state holds no pages: no layer
    vm, netns = await fleet.restore(first)
    await _check(netns, "one", pid)
    second = await _save(vm, places, "two", netns, keep=False)
    assert second.layers == (first.state_file,) and second.memory_file == first.memory_file
    # What changed since the first pause, not everything since the base.
    assert _size(second.state_file) < _size(first.state_file)
    vm, netns = await fleet.restore(second)
    await _check(netns, "two", pid)
    snapshot = await _save(vm, places, "snap", netns, keep=True)
    assert snapshot.layers == (first.state_file, second.state_file)
    third = await _save(vm, places, "three", netns, keep=False)
    assert third.layers == (first.state_file, second.state_file)
    clones = await fleet.restore_many(snapshot, 2)
    for _, clone_netns in clones:
        await _check(clone_netns, "snap", pid)
    clone, clone_netns = clones[0]
    grandchild = await _save(clone, places, "grand", clone_netns, keep=False)
    assert grandchild.layers == (first.state_file, second.state_file, snapshot.state_file)
    vm, netns = await fleet.restore(grandchild)
    await _check(netns, "grand", pid)
    await vm.stop()
    vm, netns = await fleet.restore(third)
    await _check(netns, "three", pid)
    await vm.stop()
    merged_dir = places.snapshot_target().directory
    merged = await fleet.driver.merge_layers(grandchild, merged_dir)
    assert merged.layers == () and merged.state_file.parent == merged_dir
    vm, netns = await fleet.restore(merged)
    await _check(netns, "grand", pid)
    assert isinstance(vm, QemuVM) and vm.ram_layers == (merged.state_file,)


async def test_a_layered_pause_restores_from_the_repository_on_an_empty_cache(
    fleet: Fleet, template: Template, places: Places, tmp_path: Path
) -> None:
    """The layers go up as files of their own, so a second pause uploads little beyond its own
    state; another node (its own home, an empty chunk cache) pulls it and restores it."""
    vm, netns = await fleet.restore(template.snapshot)
    first = await _save(vm, places, "up-one", netns, keep=False)
    vm, netns = await fleet.restore(first)
    second = await _save(vm, places, "up-two", netns, keep=False)
    await vm.stop()
    store = tmp_path / "repository"
    here = open_archive(Config(home=tmp_path / "here", repository=str(store)))
    there = open_archive(Config(home=tmp_path / "there", repository=str(store)))
    assert here is not None and there is not None
    try:
        await here.push_checkpoint(first, tmp_path / "up1", fleet.driver, name="1", metadata={})
        before = here.repository.stats.bytes_uploaded
        manifest = await here.push_checkpoint(
            second, tmp_path / "up2", fleet.driver, name="2", metadata={}
        )
        uploaded = here.repository.stats.bytes_uploaded - before
        pulled = await there.pull(manifest, tmp_path / "there" / "pulled", fleet.driver)
        assert there.repository.stats.chunks_fetched > 0  # nothing was in its cache
    finally:
        here.close()
        there.close()
    # Compressed: at most the new state, never the first layer or the base again.
    assert uploaded <= _size(second.state_file) + MIB, uploaded
    assert len(pulled.layers) == 1 and pulled.layers[0].is_relative_to(tmp_path / "there")
    restored, restored_netns = await fleet.restore(pulled)
    assert (await agent(restored_netns))["memory"] == "up-two"
    await restored.stop()


async def test_a_vmm_killed_during_a_layered_save_leaves_the_chain(
    fleet: Fleet, template: Template, places: Places
) -> None:
    """A save cut by the VMM's death (at whatever step the kill lands) fails, leaves no state,
    and the chain it lay over still restores."""
    vm, netns = await fleet.restore(template.snapshot)
    first = await _save(vm, places, "kept", netns, keep=False)
    vm, netns = await fleet.restore(first)
    await agent(netns, "POST", "/?memory=lost&note=lost")
    assert isinstance(vm, QemuVM)
    target = places.snapshot_target()
    saving = asyncio.ensure_future(vm.snapshot(target, keep_running=False))
    await asyncio.sleep(0.01)  # within the save, or before it: either way it must fail
    os.kill(vm.proc.pid, signal.SIGKILL)
    with pytest.raises(DriverError):
        await saving
    assert not (target.directory / "state").exists()
    again, again_netns = await fleet.restore(first)
    assert (await agent(again_netns))["memory"] == "kept"
    await again.stop()
