"""Saving a VM: snapshots (seal the disks, save the machine state, continue or quit) and the
migration streams they write, whole or with only the pages the guest changed over the memory
file it maps (`ramdelta`, `ramlayers`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import logging
import os
import time
from pathlib import Path

from aenv.runtime import export, qcow2, ramdelta, ramlayers
from aenv.runtime.driver import Disk, Snapshot, SnapshotTarget, VMState
from aenv.runtime.jail import Access, JailFile
from aenv.runtime.qemu import cmdline, disks
from aenv.runtime.qemu.cmdline import RAM_BLOCK, memory_dir
from aenv.runtime.qemu.host import DRIVER_NAME
from aenv.runtime.qemu.vmm import Vmm
from aenv.runtime.qmp import MonitorError
from aenv.storage import layers
from aenv.timing import Steps

log = logging.getLogger("aenv.runtime")
MIGRATE_BANDWIDTH = 100 << 30  # bytes/s: effectively unlimited


async def snapshot(
    vm: Vmm, target: SnapshotTarget, keep_running: bool, made: list[Path], machine_state: bool
) -> Snapshot:
    """Save `vm` into `target`, naming each file it writes in `made` (the caller's to remove
    if this fails):
    1. Stop the guest.
    2. Seal each writable drive's top into the snapshot; a VM that keeps running continues on
       new tops over them.
    3. Save the machine state (or an empty file, for disks only) and the memory file.
    4. Flatten sealed layers whose chain is too deep, and write the manifest."""
    steps = Steps()
    if vm.run_state is VMState.RUNNING:
        await vm.monitor.execute("stop")
        vm.run_state = VMState.PAUSED
    steps.mark("stop")
    # vm_stop has drained and flushed every drive, so the files are consistent now.
    spec = vm.spec
    sealed: dict[str, Path] = {}
    for disk in spec.disks:
        if not disk.read_only:
            sealed[disk.drive_id] = await disks.seal(disk, target.directory, made)
    if keep_running:
        await _restack(vm, sealed)
        # From here on the running VM's disks are stacked on the sealed files: keep them
        # even if the rest of the snapshot fails.
        made[:] = [p for p in made if p not in sealed.values()]
    steps.mark("disks")
    state_file = target.directory / "state"
    made.append(state_file)
    memory_file: Path | None = None
    ram_layers: tuple[Path, ...] = ()
    if not machine_state:  # disks only: an empty state file marks it
        await asyncio.to_thread(state_file.write_bytes, b"")
        if not keep_running:
            await vm.quit()
    elif vm.memory.shared:
        await save_state(vm, state_file, ignore_shared=True)
        memory_file = target.memory_dir / "memory"
        made.append(memory_file)
        if keep_running:
            await layers.sparse_copy(vm.memory.path, memory_file)
        else:
            await hand_over_memory(vm, memory_file)
    elif not keep_running:
        # Only what changed since the memory file it maps; that file stays the base.
        ram_layers = await save_layered(vm, state_file)
        memory_file = vm.memory.path
        await vm.quit()
    else:
        # Only what changed since the memory file it maps, as a pause. Snapshots and fork
        # checkpoints outlive the base's owner and are exported with their files moved:
        # the snapshot gets the base as a hard link of its own (no bytes written; the
        # file is never written again), copied only when `memory_dir` is elsewhere.
        ram_layers = await save_layered(vm, state_file)
        memory_file = target.memory_dir / "memory"
        made.append(memory_file)
        await export.place(vm.memory.path, memory_file, move=False)
    steps.mark("state")
    for dest in sealed.values():
        await qcow2.flatten_if_deep(dest)
    steps.mark("flatten")
    snap = Snapshot(
        driver=DRIVER_NAME,
        compat=await vm.host.compat_on(vm.platform),
        spec=spec,
        state_file=state_file,
        memory_file=memory_file,
        disks=sealed,
        machine_state=machine_state,
        layers=ram_layers,
    )
    await asyncio.to_thread(snap.save_manifest)
    steps.mark("manifest")
    log.info("snapshot of VM %s: %s", vm.id, steps)
    return snap


async def save_state(vm: Vmm, state_file: Path, *, ignore_shared: bool) -> None:
    """Write the (stopped) VM's device state, and its RAM unless `ignore_shared`, as a
    migration stream into `state_file`."""
    await _migrate_prepare(vm, ignore_shared)
    await vm.monitor.pass_file("state", state_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    await _migrate(vm)


async def _migrate_prepare(vm: Vmm, ignore_shared: bool) -> None:
    await vm.monitor.execute(
        "migrate-set-capabilities",
        capabilities=[{"capability": "x-ignore-shared", "state": ignore_shared}],
    )
    await vm.monitor.execute("migrate-set-parameters", **{"max-bandwidth": MIGRATE_BANDWIDTH})


async def _migrate(vm: Vmm) -> None:
    await vm.monitor.execute("migrate", uri="fd:state")
    await vm.monitor.wait_migration(vm.proc, vm.host.config.migrate_timeout_s)


async def save_layered(vm: Vmm, state_file: Path) -> tuple[Path, ...]:
    """`save_delta` over the states this VM was restored from (`ram_layers`): returns the
    layers the new state lies over (`Snapshot.layers`), `()` when it is a delta against the
    base (no chain, one that cannot be read any more, or a stream kept whole)."""
    parent: ramlayers.Chain | None = None
    if vm.ram_layers:
        try:
            parent = await asyncio.to_thread(ramlayers.Chain, vm.ram_layers, RAM_BLOCK.encode())
        except (OSError, ValueError) as exc:  # StreamFormatError is a ValueError
            log.warning("saving VM %s against its base: its layers: %s", vm.id, exc)
    try:
        stats = await save_delta(vm, state_file, parent)
        return parent.holding_pages() if parent is not None and stats is not None else ()
    finally:
        if parent is not None:
            parent.close()


async def save_delta(
    vm: Vmm, state_file: Path, parent: ramlayers.Chain | None = None
) -> ramdelta.DeltaStats | None:
    """Write the (stopped) VM's device state and the pages it changed in its privately
    mapped memory file as a migration stream into `state_file` (see `ramdelta`). Once this
    driver's QEMU has shown that the filter understands its streams, QEMU migrates into a
    pipe that the filter reads as it goes; until then (the first save of each server) QEMU
    writes its whole stream into a scratch file beside the memory (tmpfs) and a stream the
    filter does not understand is kept whole (None), which restores all the same."""
    started = time.perf_counter()
    keep = await asyncio.to_thread(ramdelta.changed_pages, vm.proc.pid, vm.memory.path)
    same: ramdelta.Same | None = None
    if parent is not None:
        # The chain's pages too: one the VMM gave back to its file (a discard) differs.
        keep = keep.union(parent.where)
        same = parent.same
    mapped = time.perf_counter()
    stats: ramdelta.DeltaStats | None
    if vm.host.streams_understood:
        stats = await _save_through_filter(vm, state_file, keep, same)
    else:
        stats = await _save_then_filter(vm, state_file, keep, same)
        vm.host.streams_understood = stats is not None
    if stats is not None:
        log.info(
            "saved VM %s: page map %.0f ms, stream %.0f ms, kept %d of %d bytes",
            vm.id,
            (mapped - started) * 1e3,
            (time.perf_counter() - mapped) * 1e3,
            stats.bytes_out,
            stats.bytes_in,
        )
    return stats


async def _save_through_filter(
    vm: Vmm, state_file: Path, keep: frozenset[int], same: ramdelta.Same | None
) -> ramdelta.DeltaStats:
    """QEMU migrates into a pipe; `ramdelta.filter_pipe` writes the changed pages' records
    into `state_file` as they come. A stream it does not understand fails the save (it was
    consumed: there is nothing whole to keep) and sends later saves back to the scratch
    file."""
    read, write = os.pipe2(os.O_CLOEXEC)
    with contextlib.suppress(OSError):  # beyond the user's pipe quota: the default size
        fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, ramdelta.PIPE_BUFFER)
    filtering = asyncio.ensure_future(
        asyncio.to_thread(ramdelta.filter_pipe, read, state_file, RAM_BLOCK, keep, same)
    )

    def done(task: asyncio.Future[ramdelta.DeltaStats]) -> None:
        # The read end is closed once the thread is done with it, whoever waits for it;
        # a save that failed otherwise leaves the filter's error here.
        os.close(read)
        if not task.cancelled():
            task.exception()

    filtering.add_done_callback(done)
    try:
        try:
            await _migrate_prepare(vm, ignore_shared=True)
            await vm.monitor.pass_fd("state", write)
        finally:
            os.close(write)  # QEMU holds the only write end now: its close ends the stream
        async with contextlib.AsyncExitStack() as undo:
            # A migration that never started leaves the fd with QEMU; closing it ends the
            # filter's read. One that started closed it when it failed.
            undo.push_async_callback(_close_fd, vm, "state")
            await _migrate(vm)
            undo.pop_all()
        # Shielded: cancelling the thread's task would not stop the thread.
        return await asyncio.shield(filtering)
    except ramdelta.StreamFormatError:
        vm.host.streams_understood = False
        raise


async def _close_fd(vm: Vmm, name: str) -> None:
    """Close the fd QEMU holds as `name`, if it still holds one."""
    with contextlib.suppress(MonitorError):
        await vm.monitor.execute("closefd", fdname=name)


async def _save_then_filter(
    vm: Vmm, state_file: Path, keep: frozenset[int], same: ramdelta.Same | None
) -> ramdelta.DeltaStats | None:
    scratch = memory_dir(vm.spec) / f"{vm.id}.stream"
    try:
        await save_state(vm, scratch, ignore_shared=True)
        try:
            return await asyncio.to_thread(
                ramdelta.filter_file, scratch, state_file, RAM_BLOCK, keep, same
            )
        except ramdelta.StreamFormatError as exc:
            log.warning("saving VM %s with all of its RAM: %s", vm.id, exc)
            await export.place(scratch, state_file, move=True)
            return None
    finally:
        await asyncio.to_thread(disks.unlink, [scratch])


async def hand_over_memory(vm: Vmm, dest: Path) -> None:
    """Quit QEMU and give its (shared, owned) memory file the name `dest`."""
    await vm.quit()
    await export.place(vm.memory.path, dest, move=True)
    vm.memory = dataclasses.replace(vm.memory, owned=False)


async def _restack(vm: Vmm, sealed: dict[str, Path]) -> None:
    """Continue each writable drive on a new empty top over its sealed layer. The top is made
    by us (`mode=existing`) so that its header names the sealed layer, not the workdir file."""
    vm.generation += 1
    stacked: list[Disk] = []
    for disk in vm.spec.disks:
        if disk.read_only:
            stacked.append(disk)
            continue
        top = vm.spec.workdir / f"{disk.drive_id}.{vm.id}.{vm.generation}.qcow2"
        await qcow2.overlay(sealed[disk.drive_id], top)
        vm.owned_files.append(top)
        if vm.jail is not None:
            await vm.jail.expose(vm.proc.pid, JailFile(top, Access.OWN))
        node = f"{disk.drive_id}-{vm.generation}"
        options = cmdline.discard_options(vm.host.config)
        await disks.stack(vm.monitor, disk.drive_id, node, top, options)
        stacked.append(Disk(disk.drive_id, top, read_only=False))
        # Record each switch at once: if a later drive fails, the spec still says where
        # every drive is now.
        vm.spec = dataclasses.replace(vm.spec, disks=tuple(stacked) + vm.spec.disks[len(stacked) :])
