"""Boot, snapshot, restore, clone, pause/resume, stop with real QEMU VMs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import psutil
import pytest

from aenv.runtime import qcow2
from aenv.runtime.cgroups import CgroupManager
from aenv.runtime.driver import CorruptSavedState, DriverError, RestoreError, Snapshot, VMState
from aenv.runtime.qemu import QemuDriver, QemuVM
from aenv.runtime.sweep import orphaned_vmms, reap_strays
from tests.runtime.qemu_vm.conftest import (
    TEMPLATE_MEMORY,
    TEMPLATE_NOTE,
    Fleet,
    Places,
    Template,
    qemu_children,
)
from tests.runtime.qemu_vm.netns import NetnsPool, agent, wait_ready
from tests.support.wait import eventually

pytestmark = pytest.mark.slow
CLONES = int(os.environ.get("AENV_TEST_CLONES", "16"))


async def test_template_snapshot_is_small_and_complete(template: Template) -> None:
    snap = template.snapshot
    assert snap.memory_file is not None and snap.memory_file.stat().st_size == 256 << 20
    # x-ignore-shared: guest RAM stays in the memory file, the state file holds devices only.
    assert snap.state_file.stat().st_size < 1 << 20
    assert set(snap.disks) == {"upper"}
    assert (snap.state_file.parent / "snapshot.json").is_file()


async def test_restore_keeps_memory_and_disk(fleet: Fleet, template: Template) -> None:
    vm, netns = await fleet.restore(template.snapshot)
    assert vm.state is VMState.RUNNING
    state = await agent(netns)
    assert state["memory"] == TEMPLATE_MEMORY
    assert state["note"] == TEMPLATE_NOTE
    assert state["hits"] == 2  # the template answered one GET (readiness) before its snapshot
    stats = await vm.stats()
    assert stats.cpu_seconds > 0 and 0 < stats.pss_bytes <= stats.rss_bytes
    cpu = vm.cpu_time()  # the cheap reading the metrics sampler takes every round
    assert cpu.seconds >= stats.cpu_seconds and cpu.started <= time.time()
    # PID 1 (aenv-init) reaps orphans re-parented to it.
    await agent(netns, "POST", "/orphan")
    await asyncio.sleep(2)
    assert (await agent(netns, path="/zombies"))["zombies"] == 0
    await vm.stop()
    await vm.stop()  # idempotent
    assert vm.state is VMState.STOPPED
    with pytest.raises(DriverError):
        vm.cpu_time()


async def test_clones_share_the_past_and_diverge(fleet: Fleet, template: Template) -> None:
    clones = await fleet.restore_many(template.snapshot, CLONES)
    await asyncio.gather(*(wait_ready(netns) for _, netns in clones))
    before = await asyncio.gather(*(agent(netns) for _, netns in clones))
    assert all(s["memory"] == TEMPLATE_MEMORY and s["note"] == TEMPLATE_NOTE for s in before)
    await asyncio.gather(
        *(agent(netns, "POST", f"/?memory=m{i}&note=n{i}") for i, (_, netns) in enumerate(clones))
    )
    after = await asyncio.gather(*(agent(netns) for _, netns in clones))
    assert [(s["memory"], s["note"]) for s in after] == [(f"m{i}", f"n{i}") for i in range(CLONES)]


async def test_pause_and_resume(fleet: Fleet, template: Template) -> None:
    vm, netns = await fleet.restore(template.snapshot)
    await agent(netns)
    await vm.pause()
    assert vm.state is VMState.PAUSED
    with pytest.raises(OSError):
        await agent(netns, limit_s=1.0)
    await vm.resume()
    assert vm.state is VMState.RUNNING
    assert (await agent(netns))["memory"] == TEMPLATE_MEMORY


async def test_snapshot_of_a_clone_keeps_running_and_restores(
    fleet: Fleet, template: Template, places: Places
) -> None:
    vm, netns = await fleet.restore(template.snapshot)
    await agent(netns, "POST", "/?memory=second&note=second-note")
    snap = await vm.snapshot(places.snapshot_target(), keep_running=True)
    # A clone maps the template's memory privately: the snapshot is the pages it changed over
    # a link to that file (see test_ramdelta.py).
    assert snap.memory_file is not None and template.snapshot.memory_file is not None
    assert snap.memory_file.stat().st_ino == template.snapshot.memory_file.stat().st_ino
    assert vm.state is VMState.RUNNING
    await agent(netns, "POST", "/?memory=after&note=after-note")
    assert (await agent(netns))["note"] == "after-note"
    # A second snapshot of the same VM stacks on the first; the chain must outlive the VM.
    second = await vm.snapshot(places.snapshot_target(), keep_running=True)
    await agent(netns, "POST", "/?memory=third&note=third-note")
    await vm.stop()
    _late, late_netns = await fleet.restore(second)
    state = await agent(late_netns)
    assert (state["memory"], state["note"]) == ("after", "after-note")

    child, child_netns = await fleet.restore(snap)
    state = await agent(child_netns)
    assert (state["memory"], state["note"]) == ("second", "second-note")
    # The child's pause is changed pages over the same base file, layered on the snapshot.
    grandchild_snap = await child.snapshot(places.snapshot_target(), keep_running=False)
    assert grandchild_snap.memory_file == snap.memory_file
    assert grandchild_snap.layers == (snap.state_file,)
    assert child.state is VMState.STOPPED
    grandchild, gc_netns = await fleet.restore(grandchild_snap)
    assert (await agent(gc_netns))["note"] == "second-note"
    assert grandchild.state is VMState.RUNNING


@pytest.mark.parametrize("role", ["state", "disk-upper"])
async def test_a_corrupt_saved_state_is_refused_and_left_as_it_is(
    fleet: Fleet, template: Template, places: Places, role: str
) -> None:
    """A real guest's pause, one byte of its migration stream or sealed disk changed: loading
    it is refused by name, the file stays as it is, and with the byte back it restores the
    guest's memory and disk."""
    vm, netns = await fleet.restore(template.snapshot)
    await agent(netns, "POST", "/?memory=kept&note=kept-note")
    snap = await vm.snapshot(places.snapshot_target(), keep_running=False)
    directory = snap.state_file.parent
    path = snap.files()[role]
    saved = path.read_bytes()
    middle = len(saved) // 2
    corrupt = saved[:middle] + bytes([saved[middle] ^ 1]) + saved[middle + 1 :]
    path.write_bytes(corrupt)
    with pytest.raises(CorruptSavedState, match=rf"file {role} \(.*\) checksum mismatch"):
        await fleet.driver.load_saved(directory)
    assert path.read_bytes() == corrupt

    path.write_bytes(saved)
    _restored, restored_netns = await fleet.restore(await fleet.driver.load_saved(directory))
    state = await agent(restored_netns)
    assert (state["memory"], state["note"]) == ("kept", "kept-note")


async def test_a_full_disk_stays_inside_its_sandbox(fleet: Fleet, template: Template) -> None:
    (full, full_netns), (_other, other_netns) = await fleet.restore_many(template.snapshot, 2)
    await asyncio.gather(wait_ready(full_netns), wait_ready(other_netns))
    result = await agent(full_netns, "POST", "/fill", limit_s=240)
    assert result["error"] == "ENOSPC"
    upper_mib = 1024  # the template's writable layer
    assert result["written"] < upper_mib << 20
    stats = await full.stats()
    assert stats.disk_bytes < (upper_mib + 64) << 20  # the host file is bounded by the layer size
    await agent(other_netns, "POST", "/?memory=fine&note=still-writable")
    assert (await agent(other_netns))["note"] == "still-writable"
    assert (await agent(full_netns))["memory"] == TEMPLATE_MEMORY  # the full one still serves


async def test_detached_memory_restores_like_a_template(
    fleet: Fleet, template: Template, places: Places
) -> None:
    vm, netns = await fleet.restore(template.snapshot)
    await agent(netns, "POST", "/?memory=detach-me&note=detach-note")
    # A clone's snapshot (see test_ramdelta.py) is the pages it changed over its memory file:
    # detached only when asked to flatten it, into a file of its own.
    layered = await vm.snapshot(places.snapshot_target(), keep_running=True)
    await vm.stop()
    assert layered.memory_file is not None
    assert await fleet.driver.detach_memory(layered, places.snapshot_target(), fleet.target()) is (
        layered
    )
    target = places.snapshot_target()
    detached = await fleet.driver.detach_memory(layered, target, fleet.target(), flatten=True)
    assert detached.memory_file == target.memory_dir / "memory"
    assert detached.memory_file.stat().st_ino != layered.memory_file.stat().st_ino
    assert detached.disks == layered.disks
    # Device state only: the changed pages left the stream for the memory file.
    assert detached.state_file.stat().st_size < layered.state_file.stat().st_size // 10
    assert Snapshot.load_manifest(target.directory) == detached
    assert await fleet.driver.detach_memory(detached, places.snapshot_target(), fleet.target()) is (
        detached
    )
    children = await fleet.restore_many(detached, 2)
    for _child, child_netns in children:
        state = await agent(child_netns)
        assert (state["memory"], state["note"]) == ("detach-me", "detach-note")
    await agent(children[0][1], "POST", "/?memory=only-first&note=only-first")
    assert (await agent(children[1][1]))["memory"] == "detach-me"
    # The memory file is mapped privately by restores: it never changes.
    again, again_netns = await fleet.restore(detached)
    assert (await agent(again_netns))["memory"] == "detach-me"
    assert again.state is VMState.RUNNING


async def test_filesystem_only_snapshots_hold_disks_alone(
    fleet: Fleet, template: Template, places: Places
) -> None:
    vm, netns = await fleet.restore(template.snapshot)
    await agent(netns, "POST", "/?memory=unsaved&note=fs-only")
    running = await vm.snapshot(places.snapshot_target(), keep_running=True, machine_state=False)
    assert vm.state is VMState.RUNNING
    assert (await agent(netns))["note"] == "fs-only"  # it went on running
    stopped = await vm.snapshot(places.snapshot_target(), keep_running=False, machine_state=False)
    assert vm.state is VMState.STOPPED
    for snap in (running, stopped):
        assert not snap.machine_state and snap.memory_file is None
        assert snap.state_file.stat().st_size == 0
        assert set(snap.disks) == {"upper"} and snap.disks["upper"].is_file()
        assert Snapshot.load_manifest(snap.state_file.parent) == snap
        with pytest.raises(RestoreError, match="filesystem-only"):
            await fleet.restore(snap)
        assert await fleet.driver.detach_memory(snap, places.snapshot_target(), fleet.target()) is (
            snap
        )


async def test_saved_disks_boot_and_export_standalone(
    fleet: Fleet, template: Template, places: Places
) -> None:
    """A filesystem-only snapshot of a clone: its disks boot on a fresh top of their own, and its
    export holds each drive as one standalone image that `load_saved` reads back."""
    vm, netns = await fleet.restore(template.snapshot)
    await agent(netns, "POST", "/?memory=gone&note=kept-on-disk")
    saved = await vm.snapshot(places.snapshot_target(), keep_running=False, machine_state=False)
    assert len(qcow2.chain(saved.disks["upper"])) > 1  # a top over the template's layer

    target = fleet.target()
    booted = await fleet.driver.boot_saved(saved, target)
    fleet.vms.append(booted)
    assert target.net is not None
    await wait_ready(target.net.netns)
    assert (await agent(target.net.netns))["note"] == "kept-on-disk"
    assert isinstance(booted, QemuVM)
    tops = [d.path for d in booted.spec.disks if not d.read_only]
    await booted.stop()
    assert not any(p.exists() for p in tops)  # the private tops went with the VM

    dest = places.snapshot_target().directory
    exported = await fleet.driver.export(saved, dest, move=False)
    assert qcow2.chain(exported.disks["upper"]) == [exported.disks["upper"]]
    assert saved.state_file.is_file()  # shared, not taken over
    assert await fleet.driver.load_saved(dest) == exported
    exported.disks["upper"].unlink()
    with pytest.raises(RestoreError, match="lacks"):
        await fleet.driver.load_saved(dest)


async def _loading(vm_task: asyncio.Task[object], state_file: Path) -> None:
    """Until a QEMU of this test reads `state_file` (it is restoring from it)."""
    while not vm_task.done():
        for proc in qemu_children():
            with contextlib.suppress(psutil.Error):
                if any(f.path == str(state_file) for f in proc.open_files()):
                    return
        await asyncio.sleep(0.01)
    raise AssertionError("the restore ended before it could be cancelled")


@pytest.fixture(scope="module")
async def big_stream(
    driver: QemuDriver, places: Places, nets: NetnsPool, template: Template
) -> AsyncIterator[Snapshot]:
    """A clone's snapshot with 64 MiB of changed pages in its stream: loading them takes a
    while."""
    fleet = Fleet(driver, places, nets)
    try:
        vm, netns = await fleet.restore(template.snapshot)
        script = "yes 0123456789abcdef | head -c 64M > /dev/shm/fill"
        fill = json.dumps({"argv": ["sh", "-c", script]}).encode()
        assert (await agent(netns, "POST", "/run", body=fill, limit_s=60))["rc"] == 0
        stream = await vm.snapshot(places.snapshot_target(), keep_running=True)
    finally:
        await fleet.stop_all()
    assert stream.state_file.stat().st_size > 64 << 20
    yield stream


@pytest.mark.parametrize("operation", ["restore", "detach_memory"])
async def test_cancelling_a_restore_stops_its_vmm(
    fleet: Fleet, big_stream: Snapshot, places: Places, operation: str
) -> None:
    # A kill cancels a pause's memory detach mid-restore; a client gone cancels a create.
    stream = big_stream
    work: Coroutine[Any, Any, object]
    if operation == "restore":
        work = fleet.driver.restore(stream, fleet.target())
    else:
        target = places.snapshot_target()
        work = fleet.driver.detach_memory(stream, target, fleet.target(), flatten=True)
    task = asyncio.ensure_future(work)
    await _loading(task, stream.state_file)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert qemu_children() == []


async def test_the_console_is_appended_to(fleet: Fleet, template: Template) -> None:
    # The orchestrator truncates console files past their cap: QEMU's writes must then land at
    # the file's new end (O_APPEND), not at their old offset past a hole.
    vm, _netns = await fleet.restore(template.snapshot)
    (qemu,) = qemu_children()
    for fd in os.listdir(f"/proc/{qemu.pid}/fd"):
        if os.readlink(f"/proc/{qemu.pid}/fd/{fd}") == str(vm.console_log):
            fdinfo = Path(f"/proc/{qemu.pid}/fdinfo/{fd}").read_text()
            flags = int(fdinfo.split("flags:")[1].split()[0], 8)
            assert flags & os.O_APPEND
            return
    raise AssertionError("QEMU has no console file open")


async def test_a_vmm_nothing_owns_any_more_is_reaped(
    fleet: Fleet, template: Template, cgroups: CgroupManager
) -> None:
    kept, kept_netns = await fleet.restore(template.snapshot)
    dropped = await fleet.driver.restore(template.snapshot, fleet.target())
    assert isinstance(dropped, QemuVM)
    pid, name = dropped.proc.pid, f"aenv-{dropped.id}"
    del dropped  # what a cancelled operation did before it stopped its VMs
    assert len(qemu_children()) == 2
    reaped = await asyncio.to_thread(fleet.driver.reap_unowned)
    assert reaped == [name]
    assert [p.pid for p in qemu_children()] != [pid]
    assert cgroups.names() == [QemuDriver.cgroup_name(f"aenv-{kept.id}")]
    assert (await agent(kept_netns))["memory"] == TEMPLATE_MEMORY  # the owned one runs on


async def test_a_killed_servers_vmm_adopted_by_a_subreaper_is_reaped(
    template: Template, places: Places, nets: NetnsPool, no_leaks: None
) -> None:
    """The start-up sweep kills VMMs re-parented to init; under a subreaper (systemd, a
    container's init) the VMMs of a server killed with kill -9 are not, and `reap_strays` finds
    them by the node's files in their command line."""
    home = places.vm_dir()
    workdir = home / "sandbox"
    workdir.mkdir()
    net = nets.create()
    report = home / "started.json"
    # `setsid -f`: the supervisor is not this process's descendant, as a server's is not.
    argv = ["setsid", "-f", sys.executable, "-m", "tests.runtime.qemu_vm.stray_child",
            "supervise", str(template.snapshot.state_file.parent), str(workdir),
            str(places.shm), net.netns]  # fmt: skip
    with report.open("wb") as out:
        await asyncio.to_thread(subprocess.run, argv, stdout=out, check=True)
    procs: list[psutil.Process] = []
    try:
        await eventually(lambda: report.read_text().endswith("\n"))
        started = json.loads(report.read_text())
        server, vmm = psutil.Process(started["server"]), psutil.Process(started["vmm"])
        supervisor = server.parent()
        assert supervisor is not None
        procs += [vmm, supervisor]
        os.kill(server.pid, signal.SIGKILL)
        await eventually(lambda: vmm.ppid() == supervisor.pid)
        await wait_ready(net.netns)  # the guest runs on without its server
        assert vmm.pid not in [p.pid for p in orphaned_vmms()]
        killed = await asyncio.to_thread(reap_strays, home)
        assert [v.pid for v in killed] == [vmm.pid]
        await eventually(lambda: not vmm.is_running())
        assert await asyncio.to_thread(reap_strays, home) == []
    finally:
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
