"""The Firecracker implementation of `aenv.runtime.driver.Driver`: cold boot and restore (one or
many clones), over Firecracker's REST API; what a started VM can do is `vm.py`.

Memory: a booted VM's memory is anonymous; a restore maps the snapshot's memory file MAP_PRIVATE
(Firecracker's `File` memory backend), so clones of one snapshot share its clean pages through the
host page cache and their writes stay private. A restore given the memory as a source read on
demand (`RestoreSpec.lazy_memory`: the node lacks the file) loads with the `Uffd` backend instead:
a handler beside the VM (`uffd.py`, owned by `vm.py`) fills each page the guest touches.

Disks: Firecracker has no copy-on-write block format, so the guest's init stacks the layers
(overlay of the read-only base and a writable upper, found by label). A restore gives each clone
its own copy of every sealed writable image under the same `drives/<drive_id>` name the source
used (see `placement.py`), which is how the drive paths recorded in the state file point each
clone at its own layer; read-only images are shared. A cold boot of a saved state's disks
(`boot_saved`) gets the same private copies; an export moves or links the sealed images, which
are standalone raw files already. A qcow2 image (another driver's format) is refused before
Firecracker sees it: Firecracker would hand its bytes to the guest as the disk. Network: each
clone opens the tap named in its `RestoreSpec` (a network override) inside its own namespace; the
MAC stays the source's.

Device discovery in the guest: Firecracker's devices are virtio-mmio, with no PCI bus to find them
on. On x86 Firecracker describes them two ways: `virtio_mmio.device=<size>@<addr>:<irq>` arguments
it appends to the kernel command line itself, and (releases with ACPI support) DSDT entries with
the virtio-mmio ACPI id `LNRO0005`. The Debian guest kernel (6.1, `config-6.1.0-*-amd64`) has
`CONFIG_VIRTIO_MMIO=m` with `# CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES is not set`: it ignores the
command-line form entirely. It has `CONFIG_ACPI=y`, and its `virtio_mmio.ko` carries the alias
`acpi*:LNRO0005:*`, which our initramfs loads first (`aenv.guest.initramfs.MODULES`). So with the
Debian kernel a guest sees its disks, NIC, vsock, balloon and entropy device only under a
Firecracker that passes ACPI tables; an older (pre-ACPI) Firecracker boots it without any devices
(the init waits for its root disk and fails), and needs a kernel built with
`CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES=y` instead. The driver therefore passes the caller's command
line unchanged: it adds no `virtio_mmio.device=` of its own (useless with this kernel, and
Firecracker adds them anyway) and never `acpi=off`, which would hide every device.

Leftovers: a VM's id starts with `FirecrackerConfig.id_prefix`; after the server is killed, the
startup sweep (`aenv.runtime.sweep`) kills the orphaned Firecrackers (and jailers) by that `--id`
and calls `reclaim_leftovers` to remove their cgroups, jails and files in their workdirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from pathlib import Path

from aenv.runtime import driver as d
from aenv.runtime import export, qcow2
from aenv.runtime.cgroups import CgroupLimits, CgroupManager, detect
from aenv.runtime.firecracker import host, leftovers
from aenv.runtime.firecracker import models as m
from aenv.runtime.firecracker.api import FirecrackerError
from aenv.runtime.firecracker.config import FirecrackerConfig
from aenv.runtime.firecracker.jailer import Jail, JailerConfig
from aenv.runtime.firecracker.placement import (
    DirectPlacement,
    JailedPlacement,
    Placement,
    drive_name,
)
from aenv.runtime.firecracker.process import FirecrackerProcess
from aenv.runtime.firecracker.vm import (
    DRIVER_NAME,
    FAILURES,
    STATE_FILE,
    UFFD_SOCKET,
    VSOCK_SOCKET,
    DiffBase,
    FirecrackerVM,
)
from aenv.runtime.jail import UidPool
from aenv.runtime.sweep import Vmm
from aenv.storage import layers

GUEST_IFACE = "eth0"
NO_SHARES = "Firecracker has no shared-filesystem device (virtio-9p or virtiofs)"
_DRIVE_ID = re.compile(m.DEVICE_ID_PATTERN)


class FirecrackerDriver:
    """Starts Firecracker VMs. One per host process; safe for concurrent use."""

    def __init__(
        self, config: FirecrackerConfig | None = None, cgroups: CgroupManager | None = None
    ) -> None:
        self.config = config or FirecrackerConfig()
        self._cgroups = cgroups
        jail_uids = self.config.jail_uids
        self._uids = UidPool(jail_uids) if jail_uids is not None else None

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
            with contextlib.ExitStack() as undo:
                jailer, release = self._vm_jailer(self.config.jailer)
                undo.callback(release)
                placement = JailedPlacement(
                    Jail(jailer, vm_id, binary), self.config.extra_args, on_release=release
                )
                undo.pop_all()
            return placement
        return DirectPlacement(
            workdir, vm_id, binary, self._cgroup_manager(), self.config.extra_args
        )

    def _vm_jailer(self, jailer: JailerConfig) -> tuple[JailerConfig, Callable[[], None]]:
        """One VM's jailer settings (a uid of its own when `jail_uids` is set), and what gives
        its uid back."""
        if self._uids is None or self.config.jail_uids is None:
            return jailer, lambda: None
        pool, uid = self._uids, self._uids.acquire()
        own = replace(jailer, uid=uid, gid=self.config.jail_uids.gid)
        return own, lambda: pool.release(uid)

    def _limits(self, limits: d.Limits, spec: d.VMSpec) -> CgroupLimits:
        memory = limits.memory_max_mib or spec.memory_mib + self.config.vmm_overhead_mib
        return CgroupLimits(
            memory_bytes=memory << 20,
            pids=limits.pids_max or self.config.pids_base + spec.vcpus,
            cpu_cores=limits.cpu_cores or float(spec.vcpus),
        )

    async def _launch(self, vm: FirecrackerVM, netns: str | None, limits: CgroupLimits) -> None:
        placement = vm.placement
        # Every file is staged before the jailer starts: a bind mount made later would not reach
        # the jail's mount namespace (see `jailer.py`).
        log = placement.log_path(_touch(vm.workdir / "firecracker.log"))
        metrics = placement.log_path(_touch(vm.workdir / "metrics.ndjson"))
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
        await api.put_logger(m.Logger(log_path=log, level=self.config.log_level, show_level=True))
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

    @property
    def no_shares(self) -> str | None:
        return NO_SHARES

    def kernel_image(self, kernel: d.KernelImages) -> Path:
        # Firecracker loads an uncompressed ELF kernel only (x86_64).
        return kernel.vmlinux

    async def boot(self, spec: d.VMSpec) -> FirecrackerVM:
        return await self._boot(spec, owned=set())

    async def boot_saved(self, snapshot: d.Snapshot, target: d.RestoreSpec) -> FirecrackerVM:
        """Each writable drive booted from a private copy of its sealed image (`layers/`)."""
        _check_ours(snapshot)
        if target.lazy_memory is not None:
            raise d.BootError("a boot loads no saved memory: lazy_memory is for restores")
        _check_files(snapshot, d.BootError)
        spec = replace(_restored_spec(snapshot, target), shares=target.shares)
        owned: set[Path] = set()
        try:
            await _copy_layers(snapshot, spec, owned)
        except FAILURES as exc:
            _remove(owned)
            raise d.BootError(f"cannot copy the writable layers: {exc}") from exc
        return await self._boot(spec, owned=owned)

    async def _boot(self, spec: d.VMSpec, *, owned: set[Path]) -> FirecrackerVM:
        """Cold-boot `spec`; `owned` are writable layers the VM takes over (and removes)."""
        try:
            _check_spec(spec)
        except d.BootError:
            _remove(owned)
            raise
        cfg = self.config
        vm_id = self._new_id()
        try:
            placement = self._placement(spec.workdir, vm_id)
        except FAILURES as exc:
            _remove(owned)
            raise d.BootError(f"cannot place VM {vm_id}: {exc}") from exc
        vm = FirecrackerVM(cfg, spec, vm_id, placement, diff_base=DiffBase.BOOT)
        vm.owned_layers |= owned
        async with contextlib.AsyncExitStack() as undo:
            undo.push_async_callback(vm.stop)
            try:
                kernel = vm.placement.stage(spec.kernel, "boot/vmlinux", may_copy=True)
                initrd = (
                    vm.placement.stage(spec.initrd, "boot/initrd", may_copy=True)
                    if spec.initrd
                    else None
                )
                stage = vm.placement.stage
                drives = [
                    stage(disk.path, drive_name(disk.drive_id), writable=not disk.read_only)
                    for disk in spec.disks
                ]
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
                        kernel_image_path=kernel, boot_args=spec.cmdline, initrd_path=initrd
                    )
                )
                for index, (disk, path) in enumerate(zip(spec.disks, drives, strict=True)):
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
            except FAILURES as exc:
                raise d.BootError(f"firecracker boot failed: {exc}{vm.console_tail()}") from exc
            undo.pop_all()
        vm.state = d.VMState.RUNNING
        return vm

    # --- restore ---------------------------------------------------------------------------------

    async def restore(self, snapshot: d.Snapshot, target: d.RestoreSpec) -> FirecrackerVM:
        _check_ours(snapshot)
        if target.shares:
            raise d.RestoreError("a restored VM has its snapshot's devices: shares need a boot")
        if not snapshot.machine_state:
            raise d.RestoreError("a filesystem-only snapshot cannot be restored: boot its disks")
        if snapshot.memory_file is None:
            raise d.RestoreError("firecracker snapshots always have a memory file; this has none")
        if (snapshot.spec.net is None) != (target.net is None):
            # The NIC is part of the device state: it cannot be added or dropped on restore.
            raise d.IncompatibleSnapshotError(
                "a restore needs a network attachment exactly when the snapshot's VM had one"
            )
        lazy = target.lazy_memory
        _check_files(snapshot, d.RestoreError, memory=lazy is None)
        if lazy is not None and lazy.source.size < snapshot.spec.memory_mib << 20:
            raise d.RestoreError(
                f"the memory source has {lazy.source.size} bytes, "
                f"the guest {snapshot.spec.memory_mib} MiB"
            )
        spec = _restored_spec(snapshot, target)
        vm_id = self._new_id()
        try:
            placement = self._placement(target.workdir, vm_id)
        except FAILURES as exc:
            raise d.RestoreError(f"cannot place VM {vm_id}: {exc}") from exc
        vm = FirecrackerVM(
            self.config,
            spec,
            vm_id,
            placement,
            diff_base=DiffBase.FILE,
            memory_base=snapshot.memory_file,
        )
        async with contextlib.AsyncExitStack() as undo:
            undo.push_async_callback(vm.stop)
            try:
                await self._stage_restore_disks(vm, snapshot)
                # Staged under restore/, never where a later snapshot of this VM could write:
                # writing through these links would overwrite the source snapshot.
                state = placement.stage(snapshot.state_file, f"restore/{STATE_FILE}", may_copy=True)
                backend = self._memory_backend(vm, snapshot.memory_file, lazy)
                netns = target.net.netns if target.net else None
                await self._launch(vm, netns, self._limits(target.limits, spec))
                reason = host.check_compat(snapshot.compat, vm.version)
                if reason is not None:
                    raise d.IncompatibleSnapshotError(reason)
                await vm.api.load_snapshot(
                    m.SnapshotLoadParams(
                        snapshot_path=state,
                        mem_backend=backend,
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
            except d.DriverError:
                raise
            except FAILURES as exc:
                if vm.memory_error is not None:  # the VMM stopped for it meanwhile
                    raise d.RestoreError(
                        f"firecracker restore failed: its memory could not be served: "
                        f"{vm.memory_error}"
                    ) from vm.memory_error
                raise d.RestoreError(
                    f"firecracker restore failed: {exc}{vm.console_tail()}"
                ) from exc
            undo.pop_all()
        vm.state = d.VMState.RUNNING
        return vm

    def _memory_backend(
        self, vm: FirecrackerVM, memory_file: Path, lazy: d.LazyMemory | None
    ) -> m.MemoryBackend:
        """The snapshot's memory file mapped (`File`), or, given a source read on demand, a
        `Uffd` handler listening for the load, beside the VM from now on."""
        if lazy is None:
            memory = vm.placement.stage(memory_file, "restore/memory.bin")
            return m.MemoryBackend(backend_type="File", backend_path=memory)
        socket, told = vm.placement.host_socket(UFFD_SOCKET)
        vm.serve_memory(lazy, socket)
        vm.placement.open_to_vmm(socket)
        return m.MemoryBackend(backend_type="Uffd", backend_path=told)

    async def _stage_restore_disks(self, vm: FirecrackerVM, snapshot: d.Snapshot) -> None:
        """Read-only drives: the shared image itself. Writable: a private copy of the sealed one."""
        await _copy_layers(snapshot, vm.spec, vm.owned_layers)
        for disk in vm.spec.disks:
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

    async def detach_memory(
        self,
        snapshot: d.Snapshot,
        target: d.SnapshotTarget,
        place: d.RestoreSpec,
        *,
        flatten: bool = False,
    ) -> d.Snapshot:
        # Firecracker always writes guest memory as its own file (`mem_file_path`).
        return snapshot

    async def merge_layers(self, snapshot: d.Snapshot, directory: Path) -> d.Snapshot:
        # Its memory is a whole file (a diff snapshot is merged into it at once): no layers.
        return snapshot

    async def export(
        self, snapshot: d.Snapshot, dest: Path, *, move: bool, memory_dir: Path | None = None
    ) -> d.Snapshot:
        """Sealed images are standalone raw files already: each is moved or linked like the
        state and memory files, as `disk-<drive_id>.img`."""

        async def place(drive_id: str, source: Path) -> Path:
            image = dest / f"disk-{drive_id}.img"
            await export.place(source, image, move=move)
            return image

        try:
            return await export.export(snapshot, dest, move=move, disk=place, memory_dir=memory_dir)
        except FAILURES as exc:
            raise d.SnapshotError(f"cannot export the saved state to {dest}: {exc}") from exc

    async def load_saved(self, directory: Path, *, unread: Collection[Path] = ()) -> d.Snapshot:
        snapshot = await asyncio.to_thread(export.load, directory, DRIVER_NAME, unread)
        await asyncio.to_thread(_check_files, snapshot, d.RestoreError)
        return snapshot

    def _new_id(self) -> str:
        # Also the jailer --id and cgroup name: alphanumerics and '-' only.
        return f"{self.config.id_prefix}{secrets.token_hex(8)}"

    # --- startup sweep ---------------------------------------------------------------------------

    def reclaim_leftovers(
        self, prefix: str, killed: Sequence[Vmm], live: Collection[str]
    ) -> list[Path]:
        """`aenv.runtime.sweep.Reclaimer`: after the sweep killed the orphaned VMMs, remove what
        this driver's VMs named `prefix*` left (`leftovers.reclaim`). Blocking."""
        return leftovers.reclaim(self.config, self._cgroup_manager, prefix, killed, live)


def _check_ours(snapshot: d.Snapshot) -> None:
    if snapshot.driver != DRIVER_NAME:
        raise d.IncompatibleSnapshotError(
            f"snapshot was taken by the {snapshot.driver} driver, not {DRIVER_NAME}"
        )


def _check_files(snapshot: d.Snapshot, error: type[d.DriverError], *, memory: bool = True) -> None:
    """Every file the saved state names exists (the memory file only with `memory`), and every
    disk is a raw image (Firecracker reads nothing else: a qcow2 would reach the guest as
    garbage)."""
    shared = [disk.path for disk in snapshot.spec.disks if disk.read_only]
    files = [snapshot.state_file, *snapshot.disks.values(), *shared]
    if memory and snapshot.memory_file is not None:
        files.append(snapshot.memory_file)
    for path in files:
        if not path.is_file():
            raise error(f"snapshot file missing: {path}")
    for path in (*snapshot.disks.values(), *shared):
        if qcow2.is_qcow2(path):
            raise error(f"{path} is a qcow2 image; firecracker reads raw disk images only")


async def _copy_layers(snapshot: d.Snapshot, spec: d.VMSpec, owned: set[Path]) -> None:
    """A private copy of each sealed writable image at the path `spec` gives the drive."""
    for disk in spec.disks:
        if not disk.read_only:
            disk.path.parent.mkdir(exist_ok=True)
            owned.add(disk.path)
            await layers.sparse_copy(snapshot.disks[disk.drive_id], disk.path)


def _remove(paths: set[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _check_spec(spec: d.VMSpec) -> None:
    if spec.shares:
        raise d.BootError(NO_SHARES)
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
        if disk.path.is_file() and qcow2.is_qcow2(disk.path):
            raise d.BootError(f"disk {disk.drive_id} is a qcow2 image; firecracker reads raw only")


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
