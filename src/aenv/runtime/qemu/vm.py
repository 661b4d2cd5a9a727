"""One running VMM (`QemuVM`): its run state, pause and resume, snapshots (their steps are in
`save`), stop, and what it uses of the host."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import psutil

from aenv.runtime import ramdelta
from aenv.runtime.driver import (
    CPUTime,
    DriverError,
    Snapshot,
    SnapshotError,
    SnapshotTarget,
    VMState,
    VMStats,
    process_cpu_time,
)
from aenv.runtime.qemu import save
from aenv.runtime.qemu.disks import unlink
from aenv.runtime.qemu.vmm import Vmm
from aenv.runtime.qmp import MonitorError
from aenv.storage import layers


class QemuVM(Vmm):
    """Implements `aenv.runtime.driver.VM`. Operations on one VM are serialised by a lock."""

    def _require(self, *states: VMState) -> None:
        if self.state not in states:
            raise DriverError(f"VM {self._id} is {self.state.value}")

    async def pause(self) -> None:
        async with self.lock:
            self._require(VMState.RUNNING, VMState.PAUSED)
            await self.monitor.execute("stop")
            self.run_state = VMState.PAUSED

    async def resume(self) -> None:
        async with self.lock:
            self._require(VMState.RUNNING, VMState.PAUSED)
            await self.monitor.execute("cont")
            self.run_state = VMState.RUNNING

    async def snapshot(
        self, target: SnapshotTarget, *, keep_running: bool, machine_state: bool = True
    ) -> Snapshot:
        async with self.lock:
            self._require(VMState.RUNNING, VMState.PAUSED)
            was_running = self.run_state is VMState.RUNNING
            made: list[Path] = []
            try:
                snap = await save.snapshot(self, target, keep_running, made, machine_state)
            except (MonitorError, layers.LayerError, OSError, ramdelta.StreamFormatError) as exc:
                unlink(made)
                if self.state is not VMState.STOPPED and was_running:
                    with contextlib.suppress(MonitorError):
                        await self.monitor.execute("cont")
                        self.run_state = VMState.RUNNING
                raise SnapshotError(f"snapshot failed: {exc}; {tail(self.stderr_log)}") from exc
            if keep_running and was_running:
                await self.monitor.execute("cont")
                self.run_state = VMState.RUNNING
        if not keep_running:
            await self.stop()
        return snap

    async def save_state(self, state_file: Path, *, ignore_shared: bool) -> None:
        """Write the (stopped) VM's device state, and its RAM unless `ignore_shared`, as a
        migration stream into `state_file`."""
        await save.save_state(self, state_file, ignore_shared=ignore_shared)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()
        else:
            # QEMU quit on its own; reap helpers it may have left in its process group.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        await self.monitor.close()
        self.host.release(self.jail)
        self.jail = None
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.remove)
            self.cgroup = None
        files = list(self.owned_files)
        if self.memory.owned:
            files.append(self.memory.path)
        await asyncio.to_thread(unlink, files)
        self.owned_files = []

    async def wait_exit(self) -> None:
        await self.proc.wait()

    async def stats(self) -> VMStats:
        self._require(VMState.RUNNING, VMState.PAUSED)
        return await asyncio.to_thread(self._stats)

    def cpu_time(self) -> CPUTime:
        self._require(VMState.RUNNING, VMState.PAUSED)
        return process_cpu_time(self.proc.pid)

    def _stats(self) -> VMStats:
        proc = psutil.Process(self.proc.pid)
        with proc.oneshot():
            cpu = proc.cpu_times()
            mem = proc.memory_full_info()
        # The writable tops plus every private layer below them that this VM created.
        private = {d.path for d in self.spec.disks if not d.read_only} | set(self.owned_files)
        disk = sum(layers.allocated_bytes(p) for p in private if p.exists())
        return VMStats(
            cpu_seconds=cpu.user + cpu.system,
            rss_bytes=mem.rss,
            pss_bytes=getattr(mem, "pss", mem.rss),
            disk_bytes=disk,
        )


@contextlib.asynccontextmanager
async def stopped_on_failure(
    vm: QemuVM, error: type[DriverError], what: str
) -> AsyncIterator[None]:
    """Stop `vm` when the block fails in any way, cancellation included: a VMM nobody holds
    any more would run on. QEMU's and the OS's errors become `error`; the stop is shielded, so
    a second cancellation cannot cut it short."""
    async with contextlib.AsyncExitStack() as undo:
        undo.push_async_callback(_stop_shielded, vm)
        try:
            yield
        except (MonitorError, OSError) as exc:
            raise error(f"{what}: {exc}; {tail(vm.stderr_log)}") from exc
        undo.pop_all()


async def _stop_shielded(vm: QemuVM) -> None:
    await asyncio.shield(vm.stop())


def tail(path: Path, limit: int = 1500) -> str:
    """The end of a VMM's stderr log, for error messages."""
    try:
        return path.read_text(errors="replace")[-limit:].strip()
    except OSError:
        return ""
