"""`QemuDriver`, the `aenv.runtime.driver.Driver` of QEMU: boots, restores and saved-state
operations, each handed to the module that owns it (`process`, `restore`, `disks`), and the
`compat` that names what a snapshot restores on (`platform`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
from collections.abc import Collection, Sequence
from pathlib import Path

from aenv.runtime import export, qcow2
from aenv.runtime.cgroups import CgroupManager
from aenv.runtime.driver import (
    VM,
    BootError,
    IncompatibleSnapshotError,
    KernelImages,
    RestoreError,
    RestoreSpec,
    Snapshot,
    SnapshotError,
    SnapshotTarget,
    VMSpec,
    VMState,
)
from aenv.runtime.qemu import cmdline, disks, restore
from aenv.runtime.qemu.cmdline import Memory, check_share_tags
from aenv.runtime.qemu.config import QemuConfig
from aenv.runtime.qemu.host import DRIVER_NAME, Host
from aenv.runtime.qemu.platform import Platform, host_tsc_khz, platforms
from aenv.runtime.qemu.process import Launcher
from aenv.runtime.qemu.restore import Restorer
from aenv.runtime.qemu.vm import QemuVM, stopped_on_failure
from aenv.storage import layers
from aenv.timing import Steps

log = logging.getLogger("aenv.runtime")


class QemuDriver:
    """Implements `aenv.runtime.driver.Driver` with QEMU."""

    def __init__(self, config: QemuConfig | None = None, cgroups: CgroupManager | None = None):
        self.config = config or QemuConfig()
        self.host = Host(self.config)
        self.launcher = Launcher(self.host, cgroups)
        self.restorer = Restorer(self.launcher, self.platform_of)
        self._platforms = platforms(self.config.accel)

    @property
    def streams_understood(self) -> bool:
        """Whether `ramdelta` understood a stream of this QEMU (see `save.save_delta`)."""
        return self.host.streams_understood

    def owned_vmm_names(self) -> set[str]:
        """See `Launcher.owned_vmm_names`."""
        return self.launcher.owned_vmm_names()

    @staticmethod
    def cgroup_name(vmm_name: str) -> str:
        return Launcher.cgroup_name(vmm_name)

    def reap_unowned(self) -> list[str]:
        """Implements `sweep.Reaper`. Blocking."""
        return self.launcher.reap_unowned()

    @property
    def name(self) -> str:
        return DRIVER_NAME

    async def compat(self) -> str:
        """What a snapshot must have been taken with to be restorable here."""
        return await self.compat_on(self._platforms[0])

    async def compat_on(self, platform: Platform) -> str:
        """The `compat` of a snapshot taken on `platform` (a VM restored on an older one keeps
        it, and so do its snapshots)."""
        return await self.host.compat_on(platform)

    async def platform_of(self, snapshot: Snapshot) -> Platform:
        """The platform `snapshot` was taken on, which its restore must have: ours, or an
        older one this driver still restores (see `platform.platforms`)."""
        if snapshot.driver == self.name:
            for platform in self._platforms:
                if snapshot.compat == await self.compat_on(platform):
                    return platform
        raise IncompatibleSnapshotError(
            f"snapshot from {snapshot.driver} ({snapshot.compat}) cannot be restored by "
            f"{self.name} ({await self.compat()})"
        )

    async def boot(self, spec: VMSpec) -> VM:
        missing = [p for p in (spec.kernel, spec.initrd, *(d.path for d in spec.disks)) if p]
        missing = [p for p in missing if not await asyncio.to_thread(p.is_file)]
        if missing:
            raise BootError(f"missing file(s): {', '.join(map(str, missing))}")
        check_share_tags(spec, BootError)
        kernel_cmdline = spec.cmdline
        if self.config.accel == "tcg" and "tsc_early_khz=" not in kernel_cmdline:
            kernel_cmdline += f" tsc_early_khz={await asyncio.to_thread(host_tsc_khz)}"
        slots = max(spec.share_slots, self.config.share_slots, len(spec.shares))
        spec = dataclasses.replace(spec, cmdline=kernel_cmdline, share_slots=slots)
        vm_id = secrets.token_hex(8)
        memory = Memory(cmdline.memory_dir(spec) / f"{vm_id}.mem", shared=True, owned=True)
        vm = await self.launcher.launch(
            vm_id,
            spec,
            memory,
            BootError,
            platform=self._platforms[0],
            incoming=False,
            steps=Steps(),
        )
        async with stopped_on_failure(vm, BootError, "boot failed"):
            await vm.monitor.execute("cont")
        vm.run_state = VMState.RUNNING
        return vm

    @property
    def no_shares(self) -> str | None:
        return None  # virtio-9p

    def kernel_image(self, kernel: KernelImages) -> Path:
        return kernel.bzimage

    async def boot_saved(self, snapshot: Snapshot, target: RestoreSpec) -> VM:
        """A qcow2 top over each sealed layer, in `target.workdir`, owned by the booted VM."""
        if target.lazy_memory is not None:
            raise BootError("a boot loads no saved memory: lazy_memory is for restores")
        with contextlib.ExitStack() as undo:
            try:
                drives, created = await disks.writable_tops(
                    snapshot, target.workdir, f"boot-{secrets.token_hex(4)}", undo
                )
            except (layers.LayerError, KeyError, OSError) as exc:
                raise BootError(f"cannot create writable layers: {exc}") from exc
            vm = await self.boot(restore.placed(snapshot, target, drives))
            undo.pop_all()
        assert isinstance(vm, QemuVM)
        vm.owned_files += created  # removed by its stop from here on
        return vm

    async def export(
        self, snapshot: Snapshot, dest: Path, *, move: bool, memory_dir: Path | None = None
    ) -> Snapshot:
        """Each writable drive's chain flattened into one standalone `<drive_id>.qcow2`."""

        async def flatten(drive_id: str, source: Path) -> Path:
            return await qcow2.flatten_to(source, dest / f"{drive_id}.qcow2")

        try:
            return await export.export(
                snapshot, dest, move=move, disk=flatten, memory_dir=memory_dir
            )
        except (layers.LayerError, OSError) as exc:
            raise SnapshotError(f"cannot export the saved state to {dest}: {exc}") from exc

    async def load_saved(self, directory: Path, *, unread: Collection[Path] = ()) -> Snapshot:
        return await asyncio.to_thread(export.load, directory, self.name, unread)

    async def restore(self, snapshot: Snapshot, target: RestoreSpec) -> VM:
        steps = Steps()
        vm = await self.restorer.restore_vm(snapshot, target, steps)
        async with stopped_on_failure(vm, RestoreError, "restore failed"):
            await vm.monitor.execute("cont")
        vm.run_state = VMState.RUNNING
        steps.mark("cont")
        log.info("restored VM %s: %s", vm.id, steps)
        return vm

    async def restore_many(self, snapshot: Snapshot, targets: Sequence[RestoreSpec]) -> list[VM]:
        results = await asyncio.gather(
            *(self.restore(snapshot, t) for t in targets), return_exceptions=True
        )
        vms = [r for r in results if not isinstance(r, BaseException)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(vm.stop() for vm in vms), return_exceptions=True)
            raise errors[0]
        return vms

    async def detach_memory(
        self,
        snapshot: Snapshot,
        target: SnapshotTarget,
        place: RestoreSpec,
        *,
        flatten: bool = False,
    ) -> Snapshot:
        """See `Restorer.detach_memory`."""
        return await self.restorer.detach_memory(snapshot, target, place, flatten=flatten)

    async def merge_layers(self, snapshot: Snapshot, directory: Path) -> Snapshot:
        """See `restore.merge_layers`."""
        return await restore.merge_layers(snapshot, directory)
