"""Restoring saved VMs: a VMM loading a snapshot's state (from one stream, or composed from a
chain of memory layers), and the saved states rewritten by loading them (`detach_memory`,
`merge_layers`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from aenv.runtime import export, ramdelta, ramlayers
from aenv.runtime.driver import (
    Disk,
    IncompatibleSnapshotError,
    RestoreError,
    RestoreSpec,
    Snapshot,
    SnapshotError,
    SnapshotTarget,
    VMSpec,
)
from aenv.runtime.qemu import disks, save
from aenv.runtime.qemu.cmdline import RAM_BLOCK, Memory, check_share_tags, memory_dir
from aenv.runtime.qemu.disks import unlink
from aenv.runtime.qemu.platform import Platform
from aenv.runtime.qemu.process import Launcher
from aenv.runtime.qemu.vm import QemuVM, stopped_on_failure, tail
from aenv.runtime.qmp import MonitorError
from aenv.storage import layers
from aenv.timing import Steps

log = logging.getLogger("aenv.runtime")
PlatformOf = Callable[[Snapshot], Awaitable[Platform]]


def placed(snapshot: Snapshot, target: RestoreSpec, drives: Sequence[Disk]) -> VMSpec:
    """`snapshot`'s VM at `target` (its directories, network, limits and shares) on `drives`,
    the writable tops made there. The network keeps the source's MAC: the guest driver's state
    holds it."""
    net = target.net
    if snapshot.spec.net is not None and net is not None:
        net = dataclasses.replace(net, mac=snapshot.spec.net.mac)
    return dataclasses.replace(
        snapshot.spec,
        workdir=target.workdir,
        memory_dir=target.memory_dir,
        net=net,
        limits=target.limits,
        disks=tuple(drives),
        shares=target.shares,
    )


class Restorer:
    """The restores of one driver: VMMs started by `launcher`, each on the platform its
    snapshot was taken on (`platform_of`, which refuses snapshots not restorable here)."""

    def __init__(self, launcher: Launcher, platform_of: PlatformOf) -> None:
        self.launcher = launcher
        self.platform_of = platform_of

    async def detach_memory(
        self,
        snapshot: Snapshot,
        target: SnapshotTarget,
        place: RestoreSpec,
        *,
        flatten: bool = False,
    ) -> Snapshot:
        """The same saved VM with its RAM moved out of the state stream into a memory file
        (`target.memory_dir/memory`, state in `target.directory/state`), so that restores map it
        instead of parsing it: a clone's checkpoint restores as fast as a template then. With
        `flatten`, also a state that carries changed pages over its memory file: the file and
        the pages become one file, which restores share entirely (a template's). The guest
        never runs meanwhile; `place` is where the loading VMM lives (it needs a tap like any
        restore, and loads the memory into `place.memory_dir`, which should be tmpfs: a shared
        mapping of a file on a disk filesystem fills 3x slower than one on tmpfs plus a copy).
        Disks are untouched and shared with `snapshot`."""
        if not snapshot.machine_state or (snapshot.memory_file is not None and not flatten):
            return snapshot
        if snapshot.memory_file is None:
            return await self._detach(snapshot, target, place)
        # A VMM cannot load pages into a block it shares with its file: one loads the layered
        # state and saves all of its RAM into a stream, which the next loads into a file.
        whole = await self._whole_stream(snapshot, place)
        try:
            detached = await self._detach(whole, target, place)
        finally:
            await asyncio.to_thread(unlink, [whole.state_file])
        return detached

    async def _whole_stream(self, snapshot: Snapshot, place: RestoreSpec) -> Snapshot:
        """`snapshot` with all of its RAM in a state stream of its own (in `place.memory_dir`)
        and no memory file: loaded and saved again, its manifest not written."""
        vm = await self.restore_vm(snapshot, place)
        stream = memory_dir(vm.spec) / f"{vm.id}.whole"
        try:
            with contextlib.ExitStack() as undo:
                undo.callback(unlink, [stream])  # made even if the save fails
                try:
                    await vm.save_state(stream, ignore_shared=False)
                except (MonitorError, OSError) as exc:
                    raise SnapshotError(
                        f"cannot flatten memory: {exc}; {tail(vm.stderr_log)}"
                    ) from exc
                undo.pop_all()
        finally:
            await asyncio.shield(vm.stop())  # it only loaded and saved: never handed out
        return dataclasses.replace(snapshot, state_file=stream, memory_file=None, layers=())

    async def _detach(
        self, snapshot: Snapshot, target: SnapshotTarget, place: RestoreSpec
    ) -> Snapshot:
        vm = await self.restore_vm(snapshot, place)
        state_file = target.directory / "state"
        memory_file = target.memory_dir / "memory"
        try:
            with contextlib.ExitStack() as undo:
                try:
                    # Each file's removal is pushed before the step that makes it: a step that
                    # fails may have made it all the same.
                    undo.callback(unlink, [state_file])
                    await vm.save_state(state_file, ignore_shared=True)
                    undo.callback(unlink, [memory_file])
                    await save.hand_over_memory(vm, memory_file)
                except (MonitorError, layers.LayerError, OSError) as exc:
                    raise SnapshotError(
                        f"cannot detach memory: {exc}; {tail(vm.stderr_log)}"
                    ) from exc
                undo.pop_all()
        finally:
            await asyncio.shield(vm.stop())  # it only loaded and saved: never handed out
        detached = dataclasses.replace(snapshot, state_file=state_file, memory_file=memory_file)
        await asyncio.to_thread(detached.save_manifest)
        return detached

    async def restore_vm(
        self, snapshot: Snapshot, target: RestoreSpec, steps: Steps | None = None
    ) -> QemuVM:
        """A VMM holding `snapshot`'s state, its vCPUs not started yet (the time of each step
        into `steps`)."""
        steps = steps or Steps()
        platform = await self._check(snapshot)
        slots = snapshot.spec.share_slots
        if len(target.shares) > slots:
            raise RestoreError(
                f"a restored VM has its snapshot's devices ({slots} share slots): "
                f"{len(target.shares)} shares need a boot"
            )
        if target.lazy_memory is not None:
            # QEMU maps its memory file: a lazily served one is a FUSE file at its path.
            raise RestoreError("the qemu driver maps its memory file; it takes no memory source")
        if not await asyncio.to_thread(target.workdir.is_dir):
            raise RestoreError(f"workdir {target.workdir} does not exist")
        if (snapshot.spec.net is None) != (target.net is None):
            raise IncompatibleSnapshotError("the restore must have a network iff the source had")
        vm_id = secrets.token_hex(8)
        with contextlib.ExitStack() as undo:
            try:
                drives, created = await disks.writable_tops(snapshot, target.workdir, vm_id, undo)
            except (layers.LayerError, KeyError) as exc:
                raise RestoreError(f"cannot create writable layers: {exc}") from exc
            steps.mark("check+tops")
            spec = placed(snapshot, target, drives)
            check_share_tags(spec, RestoreError)
            if snapshot.memory_file is not None:
                memory = Memory(snapshot.memory_file, shared=False, owned=False)
            else:
                memory = Memory(memory_dir(spec) / f"{vm_id}.mem", shared=True, owned=True)
            vm = await self.launcher.launch(
                vm_id, spec, memory, RestoreError, platform=platform, incoming=True, steps=steps
            )
            undo.pop_all()
        vm.owned_files += created  # removed by its stop from here on
        async with stopped_on_failure(vm, RestoreError, "restore failed"):
            if not memory.shared:
                await vm.monitor.execute(
                    "migrate-set-capabilities",
                    capabilities=[{"capability": "x-ignore-shared", "state": True}],
                )
                vm.ram_layers = await asyncio.to_thread(
                    ramlayers.chain, snapshot.layers, snapshot.state_file, spec.memory_mib << 20
                )
            if snapshot.layers:
                await _load_layers(vm, snapshot, self.launcher.config.migrate_timeout_s)
            else:
                await vm.monitor.pass_file("state", snapshot.state_file, os.O_RDONLY)
                await vm.monitor.execute("migrate-incoming", uri="fd:state")
                await vm.monitor.wait_incoming(vm.proc, self.launcher.config.migrate_timeout_s)
        steps.mark("incoming")
        return vm

    async def _check(self, snapshot: Snapshot) -> Platform:
        """Raises unless `snapshot` can be restored here; returns the platform to restore it on."""
        if not snapshot.machine_state:
            raise RestoreError("a filesystem-only snapshot cannot be restored: boot its disks")
        platform = await self.platform_of(snapshot)
        files = [snapshot.state_file, snapshot.spec.kernel, *snapshot.disks.values()]
        files += [p for p in (snapshot.memory_file, snapshot.spec.initrd) if p]
        files += [d.path for d in snapshot.spec.disks if d.read_only]
        files += snapshot.layers
        missing = [p for p in files if not await asyncio.to_thread(p.is_file)]
        if missing:
            raise RestoreError(f"snapshot is missing file(s): {', '.join(map(str, missing))}")
        return platform


async def merge_layers(snapshot: Snapshot, directory: Path) -> Snapshot:
    """The chain composed as a restore would load it (`ramlayers.compose_into`), written
    into `directory/state`: one delta over the base memory file."""
    if not snapshot.layers:
        return snapshot
    state_file = directory / export.STATE
    states = (*snapshot.layers, snapshot.state_file)

    def merge() -> None:
        with open(state_file, "wb") as out:
            ramlayers.compose_into(states, RAM_BLOCK.encode(), out.fileno())

    async with contextlib.AsyncExitStack() as undo:
        undo.push_async_callback(asyncio.to_thread, unlink, [state_file])  # made even if it fails
        try:
            await asyncio.to_thread(merge)
        except (OSError, ValueError) as exc:  # StreamFormatError is a ValueError
            raise SnapshotError(f"cannot merge the memory layers: {exc}") from exc
        undo.pop_all()
    return dataclasses.replace(snapshot, state_file=state_file, layers=())


async def _load_layers(vm: QemuVM, snapshot: Snapshot, timeout_s: float) -> None:
    """QEMU loads a layered state as one stream that `ramlayers.compose_into` writes into a
    pipe: the chain is never written whole. A composition that fails ends the stream short,
    so QEMU refuses it and the restore fails (`RestoreError`)."""
    states = (*snapshot.layers, snapshot.state_file)
    read, write = os.pipe2(os.O_CLOEXEC)
    with contextlib.suppress(OSError):  # beyond the user's pipe quota: the default size
        fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, ramdelta.PIPE_BUFFER)

    def compose() -> int:
        try:
            return ramlayers.compose_into(states, RAM_BLOCK.encode(), write)
        finally:
            os.close(write)

    composing = asyncio.ensure_future(asyncio.to_thread(compose))
    # Not awaited when the load fails: a writer blocked on a full pipe ends only when the
    # VMM (the read end) is stopped, after this returns.
    composing.add_done_callback(lambda task: task.cancelled() or task.exception())
    try:
        await vm.monitor.pass_fd("state", read)
    finally:
        os.close(read)  # QEMU holds the only read end now
    await vm.monitor.execute("migrate-incoming", uri="fd:state")
    await vm.monitor.wait_incoming(vm.proc, timeout_s)
    try:
        older = await asyncio.shield(composing)
    except ValueError as exc:  # a StreamFormatError, or a layer that is empty
        raise OSError(f"cannot compose the memory layers: {exc}") from exc
    log.info("restored VM %s from %d states, %d pages of older ones", vm.id, len(states), older)
