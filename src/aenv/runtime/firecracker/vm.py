"""One Firecracker VM, booted or restored: pause, resume, snapshot, stop, stats, and the
Firecracker-only extras (balloon, MMDS, vsock).

Snapshots: with dirty-page tracking on, a snapshot is a `Diff` holding only the pages written since
boot, restore or the previous snapshot; a booted VM's first diff is complete (unwritten memory is
zeros), a later one is laid over the memory it is relative to (`memfile.merge_diff`), so every
snapshot's memory file can be restored on its own. Any failure after Firecracker wrote a snapshot
resets its dirty log, so the next snapshot is a `Full` one. Writable drives are sealed while the VM
is paused: copied (sparse, reflinked where possible), or, when the VM stops anyway and the layer is
the driver's own, sealed under a second name. A snapshot that cannot be completed (including the
VM failing to continue afterwards) is deleted and the VM is left running as it was, if it can be.

Host files of one VM, all inside its workdir (or its jail): `api.sock`, `console.log` (the serial
console: Firecracker's stdout), `firecracker.err`, `firecracker.log`, `metrics.ndjson`, `drives/`,
`layers/` (a restored VM's private writable disks), `vsock.sock` and `uffd.sock`; `stop()` removes
them.

Memory on demand (`d.LazyMemory`): a VM restored with the `Uffd` backend has a page-fault handler
(`uffd.py`) beside it from before the load until its end. The VM owns it: `stop` (also after a
crash or a kill from outside, when the owner calls it) ends the VMM first, then the handler. A
handler that fails (a page no source gives, a VMM that breaks the protocol) is reported to the
restore's owner and the VM is stopped: its vCPUs would otherwise wait on that page for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import secrets
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from aenv.runtime import driver as d
from aenv.runtime.cgroups import CgroupError
from aenv.runtime.firecracker import host, memfile
from aenv.runtime.firecracker import models as m
from aenv.runtime.firecracker.api import FirecrackerApi, FirecrackerError
from aenv.runtime.firecracker.config import FirecrackerConfig
from aenv.runtime.firecracker.placement import Placement
from aenv.runtime.firecracker.process import FirecrackerProcess
from aenv.runtime.firecracker.uffd import UffdHandler
from aenv.runtime.jail import JailError
from aenv.storage import layers
from aenv.storage.layers import LayerError

log = logging.getLogger("aenv.runtime")

DRIVER_NAME = "firecracker"
STATE_FILE = "vmstate.bin"
VSOCK_SOCKET = "vsock.sock"  # relative: every VM, and every clone, has its own in its own cwd
UFFD_SOCKET = "uffd.sock"  # a lazily restored VM's page-fault handler, in its cwd too
# What a failed VMM operation can raise below the driver; each becomes the operation's DriverError.
FAILURES = (
    FirecrackerError,
    JailError,
    CgroupError,
    LayerError,
    memfile.MemoryFileError,
    OSError,
)
_CONSOLE_TAIL = 2048
_LOG_FILES = ("console.log", "firecracker.err", "firecracker.log", "metrics.ndjson", VSOCK_SOCKET)


class DiffBase(enum.Enum):
    """What a `Diff` snapshot of this VM would be relative to."""

    BOOT = "boot"  # booted and never snapshotted: the diff is the whole memory
    FILE = "file"  # restored or snapshotted: the diff goes over `_memory_base`
    NONE = "none"  # no usable base (tracking off, or a base was lost): take a Full snapshot


class FirecrackerVM:
    """One Firecracker VM (booted or restored) and the files and process it owns."""

    def __init__(
        self,
        config: FirecrackerConfig,
        spec: d.VMSpec,
        vm_id: str,
        placement: Placement,
        *,
        diff_base: DiffBase,
        memory_base: Path | None = None,
    ) -> None:
        self._config = config
        self.spec = spec  # as placed: for a restored VM, its own workdir, layers and tap
        self.workdir = spec.workdir
        self._id = vm_id
        self.placement = placement
        self.state = d.VMState.STOPPED
        self.version = ""
        self.process: FirecrackerProcess | None = None
        self._released = False
        # Writable layers this driver created (restored VMs); the caller owns a booted VM's disks.
        self.owned_layers: set[Path] = set()
        self._diff_base = diff_base if config.track_dirty_pages else DiffBase.NONE
        self._memory_base = memory_base
        self._lock = asyncio.Lock()
        self.uffd: UffdHandler | None = None  # serves its memory when restored lazily
        self.memory_error: BaseException | None = None  # why its memory could not be served
        self._failure_stop: asyncio.Future[None] | None = None

    # --- VM protocol -----------------------------------------------------------------------------

    @property
    def id(self) -> str:
        return self._id

    @property
    def console_log(self) -> Path:
        return self.workdir / "console.log"

    @property
    def share_slots(self) -> int:
        return 0  # Firecracker has no shared-filesystem device

    @property
    def vsock_path(self) -> Path | None:
        """Where the host connects to the guest's vsock (`CONNECT <port>`), if configured."""
        if self._config.vsock_cid is None:
            return None
        return self.placement.cwd / VSOCK_SOCKET

    @property
    def api(self) -> FirecrackerApi:
        if self.process is None:
            raise d.DriverError(f"VM {self.id} has no running firecracker")
        return self.process.api

    async def pause(self) -> None:
        async with self._lock:
            self._require_live()
            await self._guard(self.api.pause(), "pause")
            self.state = d.VMState.PAUSED

    async def resume(self) -> None:
        async with self._lock:
            self._require_live()
            await self._guard(self.api.resume(), "resume")
            self.state = d.VMState.RUNNING

    async def snapshot(
        self, target: d.SnapshotTarget, *, keep_running: bool, machine_state: bool = True
    ) -> d.Snapshot:
        async with self._lock:
            self._require_live()
            was_running = self.state is d.VMState.RUNNING
            async with contextlib.AsyncExitStack() as undo:
                if was_running:
                    await self._guard(self.api.pause(), "pause for snapshot", d.SnapshotError)
                    self.state = d.VMState.PAUSED
                    undo.push_async_callback(self._resume_after_failure)
                snap = await self._take_snapshot(
                    target, keep_running=keep_running, machine_state=machine_state
                )
                # Saved, but if the VM does not continue the operation as a whole failed.
                undo.callback(_discard_snapshot, snap)
                if keep_running and was_running:
                    await self._guard(self.api.resume(), "resume after snapshot", d.SnapshotError)
                    self.state = d.VMState.RUNNING
                undo.pop_all()
            if not keep_running:
                await self._stop_locked()
            return snap

    async def _resume_after_failure(self) -> None:
        with contextlib.suppress(FirecrackerError):
            await self.api.resume()
            self.state = d.VMState.RUNNING

    async def wait_exit(self) -> None:
        if self.process is not None:
            await self.process.wait()

    async def stop(self) -> None:
        async with self._lock:
            await self._stop_locked()

    async def stats(self) -> d.VMStats:
        self._require_live()
        assert self.process is not None
        pid = self.process.pid
        disks = [disk.path for disk in self.spec.disks if not disk.read_only]
        return await asyncio.to_thread(_read_stats, pid, disks)

    def cpu_time(self) -> d.CPUTime:
        self._require_live()
        assert self.process is not None
        return d.process_cpu_time(self.process.pid)

    # --- Firecracker extras ----------------------------------------------------------------------

    async def balloon_stats(self) -> m.BalloonStats:
        return await self.api.balloon_stats()

    async def set_balloon_target(self, amount_mib: int) -> None:
        await self.api.patch_balloon(m.BalloonUpdate(amount_mib=amount_mib))

    async def put_metadata(self, data: Mapping[str, Any]) -> None:
        """Replace the MMDS data store (lost on snapshot: set it again after each restore)."""
        await self.api.put_mmds(data)

    def console_tail(self) -> str:
        try:
            text = self.console_log.read_bytes()[-_CONSOLE_TAIL:].decode(errors="replace")
        except OSError:
            return ""
        return f"\n--- console tail ---\n{text}" if text.strip() else ""

    # --- memory on demand ------------------------------------------------------------------------

    def serve_memory(self, lazy: d.LazyMemory, socket: Path) -> None:
        """Serve the guest's memory from `lazy.source` by a `Uffd` handler listening at `socket`
        (which must not exist), from now (before the snapshot load) until the VM stops."""
        loop = asyncio.get_running_loop()

        def failed(error: Exception) -> None:  # on the handler's thread
            loop.call_soon_threadsafe(self._memory_failed, error, lazy)

        self.uffd = UffdHandler(lazy.source, socket, failed)
        self.uffd.start(loop)

    def _memory_failed(self, error: BaseException, lazy: d.LazyMemory) -> None:
        if self._released or self.memory_error is not None:
            return
        log.error("VM %s: its memory could not be served (%s); stopping it", self.id, error)
        self.memory_error = error
        lazy.on_failure(error)
        self._failure_stop = asyncio.ensure_future(self.stop())

    # --- internals -------------------------------------------------------------------------------

    def _require_live(self) -> None:
        if self.state is d.VMState.STOPPED or self.process is None:
            raise d.DriverError(f"VM {self.id} is stopped")

    async def _guard(
        self,
        call: Awaitable[None],
        what: str,
        error: type[d.DriverError] = d.DriverError,
    ) -> None:
        try:
            await call
        except FirecrackerError as exc:
            raise error(f"firecracker {what} failed for VM {self.id}: {exc}") from exc

    async def _take_snapshot(
        self, target: d.SnapshotTarget, *, keep_running: bool, machine_state: bool
    ) -> d.Snapshot:
        state_file = target.directory / STATE_FILE
        memory_file: Path | None = None
        created: list[Path] = [state_file]
        with contextlib.ExitStack() as undo:
            undo.callback(_discard, created)  # the steps add each file they make
            try:
                target.directory.mkdir(parents=True, exist_ok=True)
                if machine_state:
                    memory_file = await self._save_machine(target, state_file, created)
                else:
                    # Filesystem-only: an empty state file marks it; Firecracker's own snapshot,
                    # and its dirty-page log, are left alone.
                    state_file.write_bytes(b"")
                sealed = await self._seal_disks(target.directory, keep_running, created)
            except FAILURES as exc:
                raise d.SnapshotError(f"snapshot of VM {self.id} failed: {exc}") from exc
            undo.pop_all()
        if memory_file is not None and self._config.track_dirty_pages:
            self._diff_base, self._memory_base = DiffBase.FILE, memory_file
        snap = d.Snapshot(
            driver=DRIVER_NAME,
            compat=host.compat_tag(self.version),
            spec=self.spec,
            state_file=state_file,
            memory_file=memory_file,
            disks=sealed,
            machine_state=machine_state,
        )
        await asyncio.to_thread(snap.save_manifest)
        return snap

    async def _save_machine(
        self, target: d.SnapshotTarget, state_file: Path, created: list[Path]
    ) -> Path:
        """Firecracker's snapshot (Full, or Diff merged over the previous memory) into
        `state_file` and a new memory file in `target.memory_dir`, which it returns."""
        placement = self.placement
        memory_file = target.memory_dir / f"memory-{secrets.token_hex(6)}.bin"
        base = self._memory_base if self._diff_base is DiffBase.FILE else None
        if base is not None and not base.is_file():
            self._diff_base, base = DiffBase.NONE, None
        kind: m.SnapshotType = "Full" if self._diff_base is DiffBase.NONE else "Diff"
        written = (
            memory_file.with_name(memory_file.name + ".diff") if base is not None else memory_file
        )
        created += [written, memory_file]
        target.memory_dir.mkdir(parents=True, exist_ok=True)
        await self._guard(
            self.api.create_snapshot(
                m.SnapshotCreateParams(
                    snapshot_path=placement.output_path(STATE_FILE, state_file),
                    mem_file_path=placement.output_path("memory.bin", written),
                    snapshot_type=kind,
                )
            ),
            "snapshot create",
            d.SnapshotError,
        )
        # Firecracker has reset its dirty log: from here a failure leaves no diff base.
        self._diff_base = DiffBase.NONE
        await asyncio.to_thread(placement.collect, STATE_FILE, state_file)
        await asyncio.to_thread(placement.collect, "memory.bin", written)
        if base is not None:
            await memfile.merge_diff(written, base, memory_file)
            written.unlink()
        return memory_file

    async def _seal_disks(
        self, directory: Path, keep_running: bool, created: list[Path]
    ) -> dict[str, Path]:
        """Each writable drive as a read-only image in `directory`. A layer this driver owns is
        sealed under a second name (hard link) when the VM stops anyway; anything else is copied
        (sparse, reflinked where the filesystem allows), which the paused VM makes consistent."""
        sealed: dict[str, Path] = {}
        for disk in self.spec.disks:
            if disk.read_only:
                continue
            destination = directory / f"disk-{disk.drive_id}.img"
            created.append(destination)
            if disk.path in self.owned_layers and not keep_running:
                await layers.seal(disk.path, destination)
            else:
                await layers.sparse_copy(disk.path, destination)
                destination.chmod(0o444)
            sealed[disk.drive_id] = destination
        return sealed

    async def _stop_locked(self) -> None:
        if self.uffd is not None:
            self.uffd.stop_serving()  # its vCPUs wait, and nothing is reported, while it ends
        if self.process is not None:
            await self.process.stop()
            self.process = None
        if self.uffd is not None:  # the VMM gone: its memory's userfaultfd can go
            await asyncio.to_thread(self.uffd.close)
            self.uffd = None
        self.state = d.VMState.STOPPED
        if not self._released:
            await asyncio.to_thread(self.placement.release)
            await asyncio.to_thread(self._remove_files)
            self._released = True

    def _remove_files(self) -> None:
        for layer in self.owned_layers:
            layer.unlink(missing_ok=True)
        self.owned_layers.clear()
        with contextlib.suppress(OSError):
            (self.workdir / "layers").rmdir()
        for name in _LOG_FILES:
            (self.workdir / name).unlink(missing_ok=True)


def _discard(paths: Iterable[Path]) -> None:
    """Best-effort removal of files a failed operation wrote (never directories)."""
    for path in paths:
        with contextlib.suppress(OSError):
            if not path.is_dir():
                path.unlink(missing_ok=True)


def _discard_snapshot(snap: d.Snapshot) -> None:
    _discard([snap.state_file, *snap.disks.values(), _manifest(snap)])
    _discard(filter(None, [snap.memory_file]))


def _manifest(snap: d.Snapshot) -> Path:
    return snap.state_file.parent / d.SNAPSHOT_MANIFEST


def _read_stats(pid: int, disks: Sequence[Path]) -> d.VMStats:
    proc = psutil.Process(pid)
    with proc.oneshot():
        cpu = proc.cpu_times()
        mem = proc.memory_full_info()
    disk = 0
    for path in disks:
        with contextlib.suppress(OSError):
            disk += layers.allocated_bytes(path)
    return d.VMStats(
        cpu_seconds=cpu.user + cpu.system, rss_bytes=mem.rss, pss_bytes=mem.pss, disk_bytes=disk
    )
