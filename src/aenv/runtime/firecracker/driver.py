"""The Firecracker implementation of `aenv.runtime.driver`: cold boot, snapshot, restore, clones,
pause, resume, stop and stats, over Firecracker's REST API.

Memory: a booted VM's memory is anonymous; a snapshot writes it to a file in the target's memory
dir, and a restore maps that file MAP_PRIVATE (Firecracker's `File` memory backend), so clones of
one snapshot share its clean pages through the host page cache. With dirty-page tracking on, a
snapshot is a `Diff` (only the pages written since boot, restore or the previous snapshot), laid
over the memory it was restored from (`memfile.merge_diff`); a booted VM's diff is complete.

Disks: Firecracker has no copy-on-write block format, so the guest's init stacks the layers
(overlay of the read-only base and a writable upper). A snapshot seals each writable drive as a
sparse (reflinked where possible) copy taken while the VM is paused, or hands the file over when
the VM stops; a restore gives each clone its own copy of the sealed image under the same
`drives/<drive_id>` name the source used (see `placement.py`), which is how the drive paths
recorded in the state file point each clone at its own layer. Network: each clone opens the tap
named in its `RestoreSpec` (a network override) inside its own namespace.

Host files of one VM, all inside its workdir (or its jail): `api.sock`, `console.log` (the serial
console: Firecracker's stdout), `firecracker.err`, `firecracker.log`, `metrics.ndjson`, `drives/`,
`layers/` (a restored VM's private writable disks) and `vsock.sock`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import re
import secrets
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from aenv.runtime import driver as d
from aenv.runtime.cgroups import CgroupError, CgroupLimits, CgroupManager, detect
from aenv.runtime.firecracker import host, memfile
from aenv.runtime.firecracker import models as m
from aenv.runtime.firecracker.api import FirecrackerApi, FirecrackerError
from aenv.runtime.firecracker.config import FirecrackerConfig
from aenv.runtime.firecracker.jailer import Jail, JailError
from aenv.runtime.firecracker.placement import (
    DirectPlacement,
    JailedPlacement,
    Placement,
    drive_name,
)
from aenv.runtime.firecracker.process import FirecrackerProcess
from aenv.storage import layers
from aenv.storage.layers import LayerError

DRIVER_NAME = "firecracker"
GUEST_IFACE = "eth0"
STATE_FILE = "vmstate.bin"
VSOCK_SOCKET = "vsock.sock"  # relative: every VM, and every clone, has its own in its own cwd
_DRIVE_ID = re.compile(m.DEVICE_ID_PATTERN)
_CONSOLE_TAIL = 2048
# What a failed VMM operation can raise below the driver; each becomes the operation's DriverError.
_FAILURES = (
    FirecrackerError,
    JailError,
    CgroupError,
    LayerError,
    memfile.MemoryFileError,
    OSError,
)
_LOG_FILES = ("console.log", "firecracker.err", "firecracker.log", "metrics.ndjson", VSOCK_SOCKET)


class _DiffBase(enum.Enum):
    """What a `Diff` snapshot of this VM would be relative to."""

    BOOT = "boot"  # booted and never snapshotted: the diff is the whole memory
    FILE = "file"  # restored or snapshotted: the diff goes over `_memory_base`
    NONE = "none"  # no usable base (tracking off, or a base was lost): take a Full snapshot


class FirecrackerDriver:
    """Starts Firecracker VMs. One per host process; safe for concurrent use."""

    def __init__(
        self, config: FirecrackerConfig | None = None, cgroups: CgroupManager | None = None
    ) -> None:
        self.config = config or FirecrackerConfig()
        self._cgroups = cgroups

    @property
    def name(self) -> str:
        return DRIVER_NAME

    # --- shared plumbing -------------------------------------------------------------------------

    def _cgroup_manager(self) -> CgroupManager:
        if self._cgroups is None:
            self._cgroups = detect(self.config.cgroup_parent)
        return self._cgroups

    def _placement(self, workdir: Path, vm_id: str) -> Placement:
        binary = host.find_binary(self.config.binary)
        if binary is None:
            raise FirecrackerError(f"firecracker binary not found: {self.config.binary}")
        if self.config.jailer is not None:
            return JailedPlacement(Jail(self.config.jailer, vm_id, binary), self.config.extra_args)
        return DirectPlacement(
            workdir, vm_id, binary, self._cgroup_manager(), self.config.extra_args
        )

    def _limits(self, limits: d.Limits, spec: d.VMSpec) -> CgroupLimits:
        memory = limits.memory_max_mib or spec.memory_mib + self.config.vmm_overhead_mib
        return CgroupLimits(
            memory_bytes=memory << 20,
            pids=limits.pids_max or self.config.pids_base + spec.vcpus,
            cpu_cores=limits.cpu_cores or float(spec.vcpus),
        )

    async def _launch(self, vm: FirecrackerVM, netns: str | None, limits: CgroupLimits) -> None:
        placement = vm.placement
        argv = placement.argv(netns, limits)
        vm.process = await FirecrackerProcess.spawn(
            argv,
            cwd=placement.cwd,
            socket_path=placement.socket_path,
            stdout_path=vm.workdir / "console.log",
            stderr_path=vm.workdir / "firecracker.err",
            ready_timeout=self.config.ready_timeout_s,
        )
        placement.confine(vm.process.pid, limits)
        api = vm.process.api
        vm.version = (await api.version()).firecracker_version
        # Logger and metrics are the only resources allowed before a snapshot load.
        log = placement.log_path(_touch(vm.workdir / "firecracker.log"))
        await api.put_logger(m.Logger(log_path=log, level=self.config.log_level, show_level=True))
        metrics = placement.log_path(_touch(vm.workdir / "metrics.ndjson"))
        await api.put_metrics(m.Metrics(metrics_path=metrics))

    def _drive(self, disk: d.Disk, path: str, *, root: bool) -> m.Drive:
        return m.Drive(
            drive_id=disk.drive_id,
            is_root_device=root,
            path_on_host=path,
            is_read_only=disk.read_only,
            io_engine=self.config.io_engine,
            rate_limiter=None if disk.read_only else self.config.disk_rate_limiter,
        )

    # --- boot ------------------------------------------------------------------------------------

    async def boot(self, spec: d.VMSpec) -> FirecrackerVM:
        _check_spec(spec)
        cfg = self.config
        vm_id = self._new_id()
        try:
            placement = self._placement(spec.workdir, vm_id)
        except _FAILURES as exc:
            raise d.BootError(f"cannot place VM {vm_id}: {exc}") from exc
        vm = FirecrackerVM(self, spec, spec.workdir, vm_id, placement, diff_base=_DiffBase.BOOT)
        try:
            netns = spec.net.netns if spec.net else None
            await self._launch(vm, netns, self._limits(spec.limits, spec))
            api = vm.api
            await api.put_machine_config(
                m.MachineConfiguration(
                    vcpu_count=spec.vcpus,
                    mem_size_mib=spec.memory_mib,
                    smt=False,
                    track_dirty_pages=cfg.track_dirty_pages,
                )
            )
            await api.put_boot_source(
                m.BootSource(
                    kernel_image_path=vm.placement.stage(
                        spec.kernel, "boot/vmlinux", may_copy=True
                    ),
                    boot_args=spec.cmdline,
                    initrd_path=(
                        vm.placement.stage(spec.initrd, "boot/initrd", may_copy=True)
                        if spec.initrd
                        else None
                    ),
                )
            )
            for index, disk in enumerate(spec.disks):
                path = vm.placement.stage(
                    disk.path, drive_name(disk.drive_id), writable=not disk.read_only
                )
                # Our initramfs assembles the root; without one the first disk is the root.
                root = spec.initrd is None and index == 0
                await api.put_drive(self._drive(disk, path, root=root))
            if spec.net is not None:
                await api.put_network_interface(
                    m.NetworkInterface(
                        iface_id=GUEST_IFACE,
                        host_dev_name=spec.net.tap,
                        guest_mac=spec.net.mac,
                        rx_rate_limiter=cfg.net_rx_rate_limiter,
                        tx_rate_limiter=cfg.net_tx_rate_limiter,
                    )
                )
                if cfg.mmds_version is not None:
                    await api.put_mmds_config(
                        m.MmdsConfig(network_interfaces=[GUEST_IFACE], version=cfg.mmds_version)
                    )
            if cfg.vsock_cid is not None:
                await api.put_vsock(m.Vsock(guest_cid=cfg.vsock_cid, uds_path=VSOCK_SOCKET))
            if cfg.balloon is not None:
                await api.put_balloon(cfg.balloon)
            if cfg.entropy is not None:
                await api.put_entropy(cfg.entropy)
            await api.start()
        except BaseException as exc:
            detail = vm.console_tail()
            await vm.stop()
            if isinstance(exc, _FAILURES):
                raise d.BootError(f"firecracker boot failed: {exc}{detail}") from exc
            raise
        vm.state = d.VMState.RUNNING
        return vm

    # --- restore ---------------------------------------------------------------------------------

    async def restore(self, snapshot: d.Snapshot, target: d.RestoreSpec) -> FirecrackerVM:
        if snapshot.driver != DRIVER_NAME:
            raise d.IncompatibleSnapshotError(
                f"snapshot was taken by the {snapshot.driver} driver, not {DRIVER_NAME}"
            )
        if snapshot.memory_file is None:
            raise d.RestoreError("firecracker snapshots always have a memory file; this has none")
        if (snapshot.spec.net is None) != (target.net is None):
            # The NIC is part of the device state: it cannot be added or dropped on restore.
            raise d.IncompatibleSnapshotError(
                "a restore needs a network attachment exactly when the snapshot's VM had one"
            )
        shared = [disk.path for disk in snapshot.spec.disks if disk.read_only]
        for path in (snapshot.state_file, snapshot.memory_file, *snapshot.disks.values(), *shared):
            if not path.is_file():
                raise d.RestoreError(f"snapshot file missing: {path}")
        spec = _restored_spec(snapshot, target)
        vm_id = self._new_id()
        try:
            placement = self._placement(target.workdir, vm_id)
        except _FAILURES as exc:
            raise d.RestoreError(f"cannot place VM {vm_id}: {exc}") from exc
        vm = FirecrackerVM(
            self,
            spec,
            target.workdir,
            vm_id,
            placement,
            diff_base=_DiffBase.FILE,
            memory_base=snapshot.memory_file,
        )
        try:
            netns = target.net.netns if target.net else None
            await self._launch(vm, netns, self._limits(target.limits, spec))
            reason = host.check_compat(snapshot.compat, vm.version)
            if reason is not None:
                raise d.IncompatibleSnapshotError(reason)
            await self._stage_restore_disks(vm, snapshot)
            # Staged under restore/, never where a later snapshot of this VM could write: writing
            # through these links would overwrite the source snapshot.
            state = placement.stage(snapshot.state_file, f"restore/{STATE_FILE}", may_copy=True)
            memory = placement.stage(snapshot.memory_file, "restore/memory.bin")
            await vm.api.load_snapshot(
                m.SnapshotLoadParams(
                    snapshot_path=state,
                    mem_backend=m.MemoryBackend(backend_type="File", backend_path=memory),
                    track_dirty_pages=self.config.track_dirty_pages,
                    resume_vm=False,
                    network_overrides=(
                        [m.NetworkOverride(iface_id=GUEST_IFACE, host_dev_name=target.net.tap)]
                        if target.net is not None
                        else None
                    ),
                )
            )
            await self._reapply_rate_limits(vm)
            await vm.api.resume()
        except BaseException as exc:
            detail = vm.console_tail()
            await vm.stop()
            if isinstance(exc, d.DriverError):
                raise
            if isinstance(exc, _FAILURES):
                raise d.RestoreError(f"firecracker restore failed: {exc}{detail}") from exc
            raise
        vm.state = d.VMState.RUNNING
        return vm

    async def _stage_restore_disks(self, vm: FirecrackerVM, snapshot: d.Snapshot) -> None:
        """Read-only drives: the shared image itself. Writable: a private copy of the sealed one."""
        for disk in vm.spec.disks:
            if not disk.read_only:
                disk.path.parent.mkdir(exist_ok=True)
                vm.owned_layers.add(disk.path)
                await layers.sparse_copy(snapshot.disks[disk.drive_id], disk.path)
            vm.placement.stage(disk.path, drive_name(disk.drive_id), writable=not disk.read_only)

    async def _reapply_rate_limits(self, vm: FirecrackerVM) -> None:
        """Rate limiters come back from the snapshot; the host's current settings win."""
        cfg = self.config
        if cfg.disk_rate_limiter is not None:
            for disk in vm.spec.disks:
                if not disk.read_only:
                    await vm.api.patch_drive(
                        m.PartialDrive(drive_id=disk.drive_id, rate_limiter=cfg.disk_rate_limiter)
                    )
        if vm.spec.net is not None and (cfg.net_rx_rate_limiter or cfg.net_tx_rate_limiter):
            await vm.api.patch_network_interface(
                m.PartialNetworkInterface(
                    iface_id=GUEST_IFACE,
                    rx_rate_limiter=cfg.net_rx_rate_limiter,
                    tx_rate_limiter=cfg.net_tx_rate_limiter,
                )
            )

    async def restore_many(
        self, snapshot: d.Snapshot, targets: Sequence[d.RestoreSpec]
    ) -> list[d.VM]:
        results = await asyncio.gather(
            *(self.restore(snapshot, t) for t in targets), return_exceptions=True
        )
        vms: list[d.VM] = [r for r in results if isinstance(r, FirecrackerVM)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(vm.stop() for vm in vms))
            raise errors[0]
        return vms

    @staticmethod
    def _new_id() -> str:
        # Also the jailer --id and cgroup name: alphanumerics and '-' only.
        return f"fc-{secrets.token_hex(8)}"


class FirecrackerVM:
    """One Firecracker VM (booted or restored) and the files and process it owns."""

    def __init__(
        self,
        driver: FirecrackerDriver,
        spec: d.VMSpec,
        workdir: Path,
        vm_id: str,
        placement: Placement,
        *,
        diff_base: _DiffBase,
        memory_base: Path | None = None,
    ) -> None:
        self._driver = driver
        self.spec = spec
        self.workdir = workdir
        self._id = vm_id
        self.placement = placement
        self.state = d.VMState.STOPPED
        self.version = ""
        self.process: FirecrackerProcess | None = None
        self._released = False
        # Writable layers this driver created (restored VMs); the caller owns a booted VM's disks.
        self.owned_layers: set[Path] = set()
        self._diff_base = diff_base if driver.config.track_dirty_pages else _DiffBase.NONE
        self._memory_base = memory_base
        self._lock = asyncio.Lock()

    # --- VM protocol -----------------------------------------------------------------------------

    @property
    def id(self) -> str:
        return self._id

    @property
    def console_log(self) -> Path:
        return self.workdir / "console.log"

    @property
    def vsock_path(self) -> Path | None:
        """Where the host connects to the guest's vsock (`CONNECT <port>`), if configured."""
        if self._driver.config.vsock_cid is None:
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

    async def snapshot(self, target: d.SnapshotTarget, *, keep_running: bool) -> d.Snapshot:
        async with self._lock:
            self._require_live()
            was_running = self.state is d.VMState.RUNNING
            if was_running:
                await self._guard(self.api.pause(), "pause for snapshot", d.SnapshotError)
                self.state = d.VMState.PAUSED
            snap: d.Snapshot | None = None
            try:
                snap = await self._take_snapshot(target, keep_running=keep_running)
                if keep_running and was_running:
                    await self._guard(self.api.resume(), "resume after snapshot", d.SnapshotError)
                    self.state = d.VMState.RUNNING
            except BaseException:
                if snap is not None:
                    # Saved, but the VM did not continue: the operation as a whole failed.
                    _discard([snap.state_file, *snap.disks.values(), _manifest(snap)])
                    _discard(filter(None, [snap.memory_file]))
                if was_running:
                    with contextlib.suppress(FirecrackerError):
                        await self.api.resume()
                        self.state = d.VMState.RUNNING
                raise
            if not keep_running:
                await self._stop_locked()
            return snap

    async def stop(self) -> None:
        async with self._lock:
            await self._stop_locked()

    async def stats(self) -> d.VMStats:
        self._require_live()
        assert self.process is not None
        pid = self.process.pid
        disks = [disk.path for disk in self.spec.disks if not disk.read_only]
        return await asyncio.to_thread(_read_stats, pid, disks)

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

    async def _take_snapshot(self, target: d.SnapshotTarget, *, keep_running: bool) -> d.Snapshot:
        placement = self.placement
        state_file = target.directory / STATE_FILE
        memory_file = target.memory_dir / f"memory-{secrets.token_hex(6)}.bin"
        base = self._memory_base if self._diff_base is _DiffBase.FILE else None
        if base is not None and not base.is_file():
            self._diff_base, base = _DiffBase.NONE, None
        kind: m.SnapshotType = "Full" if self._diff_base is _DiffBase.NONE else "Diff"
        written = (
            memory_file.with_name(memory_file.name + ".diff") if base is not None else memory_file
        )
        created: list[Path] = [state_file, written, memory_file]
        try:
            target.directory.mkdir(parents=True, exist_ok=True)
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
            self._diff_base = _DiffBase.NONE
            await asyncio.to_thread(placement.collect, STATE_FILE, state_file)
            await asyncio.to_thread(placement.collect, "memory.bin", written)
            if base is not None:
                await memfile.merge_diff(written, base, memory_file)
                written.unlink()
            sealed = await self._seal_disks(target.directory, keep_running, created)
        except BaseException as exc:
            _discard(created)
            if isinstance(exc, _FAILURES):
                raise d.SnapshotError(f"snapshot of VM {self.id} failed: {exc}") from exc
            raise
        if self._driver.config.track_dirty_pages:
            self._diff_base, self._memory_base = _DiffBase.FILE, memory_file
        snap = d.Snapshot(
            driver=DRIVER_NAME,
            compat=host.compat_tag(self.version),
            spec=self.spec,
            state_file=state_file,
            memory_file=memory_file,
            disks=sealed,
        )
        await asyncio.to_thread(snap.save_manifest)
        return snap

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
        if self.process is not None:
            await self.process.stop()
            self.process = None
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


def _check_spec(spec: d.VMSpec) -> None:
    if not spec.kernel.is_file():
        raise d.BootError(f"kernel not found: {spec.kernel}")
    if spec.initrd is not None and not spec.initrd.is_file():
        raise d.BootError(f"initrd not found: {spec.initrd}")
    if not spec.workdir.is_dir():
        raise d.BootError(f"workdir does not exist: {spec.workdir}")
    for disk in spec.disks:
        if not _DRIVE_ID.fullmatch(disk.drive_id):
            # Firecracker's own rule, and the id names a file under drives/.
            raise d.BootError(f"drive id must match {_DRIVE_ID.pattern}: {disk.drive_id!r}")
        if not disk.path.exists():
            raise d.BootError(f"disk {disk.drive_id} not found: {disk.path}")


def _discard(paths: Iterable[Path]) -> None:
    """Best-effort removal of files a failed operation wrote (never directories)."""
    for path in paths:
        with contextlib.suppress(OSError):
            if not path.is_dir():
                path.unlink(missing_ok=True)


def _manifest(snap: d.Snapshot) -> Path:
    return snap.state_file.parent / d.SNAPSHOT_MANIFEST


def _touch(path: Path) -> Path:
    path.touch()
    return path


def _restored_spec(snapshot: d.Snapshot, target: d.RestoreSpec) -> d.VMSpec:
    """The restored VM as it is placed: its workdir, limits and network location, and a private
    writable layer (`layers/<drive_id>.img`) for each drive the snapshot sealed."""
    disks = tuple(
        disk
        if disk.read_only
        else d.Disk(disk.drive_id, target.workdir / "layers" / f"{disk.drive_id}.img")
        for disk in snapshot.spec.disks
    )
    net = snapshot.spec.net
    if net is not None and target.net is not None:
        # The guest's NIC state holds the MAC: keep the source's, take the new location.
        net = replace(target.net, mac=net.mac)
    return replace(
        snapshot.spec,
        workdir=target.workdir,
        memory_dir=target.memory_dir,
        net=net,
        limits=target.limits,
        disks=disks,
    )


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
