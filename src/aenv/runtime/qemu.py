"""The QEMU driver: `-M microvm`, KVM when it works and TCG otherwise, driven over QMP.

What `research/feasibility.md` measured, applied:
- Guest memory is a file (`memory-backend-file`, always `id=mem` so RAM block names match across
  processes). A booted VM maps its own file `share=on`, so a snapshot with `x-ignore-shared` only
  has to write device state (~60 KiB); restored VMs map the snapshot's file `share=off`, so clean
  pages are shared by every clone through the page cache and writes stay private.
- A VM whose memory is such a private mapping cannot be saved that way (its RAM is not "shared" to
  QEMU). Its saves keep the file it maps as their memory and carry only the pages the guest
  changed in the state stream (`ramdelta`: found through the mapping's page map, the rest of
  QEMU's stream filtered out); restores map that file and load the changed pages over it.
  Pauses name the mapped file itself; snapshots and fork checkpoints, which outlive the
  sandbox and whose files are moved into directories of their own, get a hard link to it.
  (A stream the filter does not understand is kept whole: it loads over the base all the
  same.) `detach_memory` turns a state whose RAM travels in the stream with no memory file
  (`Snapshot.memory_file is None`, as earlier versions saved snapshots) into the
  mapped kind by loading it (without running the guest) and saving it again.
- Snapshot = stop, freeze writable disks (`blockdev-snapshot`: the current top becomes a
  sealed layer), migrate to the state file with the bandwidth cap lifted (7.2 defaults to
  32 MiB/s), then either continue or quit.
- Restore = spawn with `-incoming defer -S`, set the same capabilities, `migrate-incoming`, `cont`.
- State files are opened by us and passed to QEMU over QMP (`getfd`, `fd:` URIs): QEMU reads and
  writes them directly, ≈ 25% faster than `exec:cat` through a pipe for a 100 MiB stream.
  A changed-pages save is the exception: QEMU migrates into a pipe that `ramdelta` filters as
  it reads, which beats writing the whole stream to a file first (see `ramdelta`).
- Under TCG the guest kernel cannot calibrate its TSC and may hang at boot: we pass the host's TSC
  frequency as `tsc_early_khz`.
- The netdev type is part of the migration stream, so every VM uses a tap (never user-mode net).
  The tap is opened by us in the slot's namespace and passed in as a file (`aenv.network.tap`).
- Every QEMU runs jailed (`aenv.runtime.jail`: own uid, no capabilities, seccomp, only its own
  files) unless `QemuConfig.jail` is None, which is for benchmarks and debugging only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import gc
import logging
import os
import re
import secrets
import signal
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import psutil

from aenv.network.tap import open_tap
from aenv.runtime import export, qcow2, ramdelta, ramlayers
from aenv.runtime.cgroups import Cgroup, CgroupLimits, CgroupManager
from aenv.runtime.driver import (
    VM,
    BootError,
    CPUTime,
    Disk,
    DriverError,
    IncompatibleSnapshotError,
    KernelImages,
    RestoreError,
    RestoreSpec,
    Snapshot,
    SnapshotError,
    SnapshotTarget,
    VMSpec,
    VMState,
    VMStats,
    process_cpu_time,
    share_tag,
)
from aenv.runtime.jail import SECCOMP, Access, Jail, JailConfig, JailFile, UidPool, host_binary
from aenv.runtime.qmp import Monitor, MonitorError
from aenv.runtime.sweep import VMM_NAME_PREFIX, reap_unowned
from aenv.storage import layers
from aenv.timing import Steps

log = logging.getLogger("aenv.runtime")

Accel = Literal["kvm", "tcg"]
RAM_BLOCK = "mem"  # the guest RAM's backend id, hence its RAM block's name in streams
MIGRATE_BANDWIDTH = 100 << 30  # bytes/s: effectively unlimited
# QEMU's own memory besides the guest's and the translation cache: heap, device state, buffers,
# libraries and the cache's bookkeeping (25-35 MiB measured, docs/density.md), with room.
VMM_OVERHEAD_MIB = 144
# TCG translation cache per VMM, in MiB. QEMU 7.2 defaults to 1 GiB (of which an idle guest
# fills a few MiB); a bound keeps a guest that runs much code from holding more. When it is
# full QEMU drops all of it and translates the guest's code again: 32 made an agent-like
# workload 3x slower, and 48 (the default until 2026-12-05) still cost a used sandbox 9% more
# host CPU than 128 on shells and Python starts (bench/guest_cpu.py), 18% over a longer run of
# SDK commands (docs/benchmarks.md). A fresh sandbox uses 22-26 MiB whatever the bound; a used
# one fills it (docs/density.md).
TCG_TB_MIB = 128
# How a VM's 9p shares (volumes) store files. mapped-xattr: the guest's owner and mode live in
# extended attributes, so guests see and change them as on any filesystem (a jailed VMM could
# not chown the host files). On the host every file is readable and writable by all (fmode,
# dmode; the VMM runs with umask 0): the VMMs of other sandboxes, each with its own uid, share
# them, while the volumes directory (0700, root) keeps host users out.
SHARE_FILE_MODES = "security_model=mapped-xattr,fmode=0666,dmode=0777"
# Share devices every booted VM gets (`VMSpec.share_slots`), so that sandboxes restored from its
# snapshots can mount that many volumes: a create with volumes is a restore, not a boot. QEMU
# refuses to save a VM while a 9p export is mounted, not while one is only present. Each slot
# is a virtio-mmio device of its own (microvm has 24 with its second IOAPIC) and costs each
# VMM ≈ 1.2 MiB (4 slots: USS +5.0 MiB, bench/vmm_memory.py): 2 cover the common case.
SHARE_SLOTS = 2
# What an unused share slot exports: empty, read-only, the same for every VMM (root's, 0755).
EMPTY_SHARE = Path("/run/aenv/empty-share")
DEFAULT_PIDS = 64
_JAIL_ENV = {"PATH": "/usr/bin:/bin"}


@dataclass(frozen=True)
class QemuConfig:
    accel: Accel = "tcg"
    binary: str = "qemu-system-x86_64"
    start_timeout_s: float = 30.0
    migrate_timeout_s: float = 120.0
    # None runs QEMU unconfined (as root, with the host's files in view): benchmarks only.
    jail: JailConfig | None = field(default_factory=JailConfig)
    # Off keeps what a guest frees allocated on the host: benchmarks only.
    discard: bool = True
    # TCG only: the translation cache's size (`-accel tcg,tb-size=`), in MiB.
    tb_size_mib: int = TCG_TB_MIB
    # Share devices of every booted VM (see `SHARE_SLOTS`).
    share_slots: int = SHARE_SLOTS


def host_tsc_khz(cpuinfo: str | None = None) -> int:
    """The host TSC frequency in kHz, from the first `cpu MHz` line of /proc/cpuinfo. TCG guests
    read the host's TSC directly, so this is the frequency their kernel must assume. (`cpu MHz` is
    the TSC rate on constant-TSC hosts without frequency scaling, such as cloud VMs.)"""
    text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    match = re.search(r"^cpu MHz\s*:\s*([0-9.]+)", text, re.MULTILINE)
    if not match:
        raise DriverError("cannot read the host TSC frequency from /proc/cpuinfo")
    return int(float(match.group(1)) * 1000)


def _opt(value: object) -> str:
    """Escape a value for QEMU's comma-separated option syntax."""
    return str(value).replace(",", ",,")


def _tail(path: Path, limit: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-limit:].strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class _Memory:
    path: Path
    shared: bool  # share=on: we own the file; share=off: private mapping of a snapshot's file
    owned: bool  # delete on stop


class QemuDriver:
    """Implements `aenv.runtime.driver.Driver` with QEMU."""

    def __init__(self, config: QemuConfig | None = None, cgroups: CgroupManager | None = None):
        self.config = config or QemuConfig()
        self._cgroups = cgroups
        self._compat: str | None = None
        self._host_cpu = "host"  # under KVM, named with the host's model in `compat`
        self._platforms = _platforms(self.config.accel)
        self._uids = UidPool(self.config.jail) if self.config.jail is not None else None
        # Every VM handed out and still referenced by someone: a VMM whose VM object is gone
        # without a stop has no owner left (see `sweep.reap_unowned`).
        self._vms: weakref.WeakValueDictionary[str, QemuVM] = weakref.WeakValueDictionary()
        self._launching: set[str] = set()
        # Whether `ramdelta` understood a stream of this QEMU (see `QemuVM.save_delta`).
        self.streams_understood = False

    def owned_vmm_names(self) -> set[str]:
        """The `-name` of every VMM being launched or that some VM object of this driver still
        stands for. Safe to call from another thread: a launch is in one set or the other at
        every moment, and a copy taken while the event loop changes them is taken again."""
        while True:
            try:
                ids = [*self._launching.copy(), *self._vms.keys()]
            except RuntimeError:  # changed size during the copy
                continue
            return {f"{VMM_NAME_PREFIX}{vm_id}" for vm_id in ids}

    @staticmethod
    def cgroup_name(vmm_name: str) -> str:
        return f"qemu-{vmm_name.removeprefix(VMM_NAME_PREFIX)}"

    def reap_unowned(self) -> list[str]:
        """Implements `sweep.Reaper`. Blocking."""
        gc.collect()  # a VM object dropped in a reference cycle is gone only after this
        return reap_unowned(self.owned_vmm_names, self._cgroups, self.cgroup_name)

    @property
    def name(self) -> str:
        return "qemu"

    async def compat(self) -> str:
        """What a snapshot must have been taken with to be restorable here."""
        return await self.compat_on(self._platforms[0])

    async def compat_on(self, platform: Platform) -> str:
        """The `compat` of a snapshot taken on `platform` (a VM restored on an older one keeps
        it, and so do its snapshots)."""
        if self._compat is None:
            proc = await asyncio.create_subprocess_exec(
                self.config.binary, "--version", stdout=asyncio.subprocess.PIPE
            )
            out, _ = await proc.communicate()
            match = re.search(r"version (\S+)", out.decode())
            version = match.group(1) if match else "unknown"
            if self.config.accel == "kvm":
                self._host_cpu = f"host:{await asyncio.to_thread(_host_cpu_model)}"
            self._compat = f"qemu-{version}/{self.config.accel}"
        cpu = platform.cpu if self.config.accel == "tcg" else self._host_cpu
        named = "" if platform.machine == UNNAMED_MACHINE else f"/{platform.machine}"
        return f"{self._compat}/{cpu}{named}"

    async def _platform_of(self, snapshot: Snapshot) -> Platform:
        """The platform `snapshot` was taken on, which its restore must have: ours, or an
        older one this driver still restores (see `_platforms`)."""
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
        _check_share_tags(spec, BootError)
        cmdline = spec.cmdline
        if self.config.accel == "tcg" and "tsc_early_khz=" not in cmdline:
            cmdline += f" tsc_early_khz={await asyncio.to_thread(host_tsc_khz)}"
        slots = max(spec.share_slots, self.config.share_slots, len(spec.shares))
        spec = dataclasses.replace(spec, cmdline=cmdline, share_slots=slots)
        vm_id = secrets.token_hex(8)
        memory = _Memory(_memory_dir(spec) / f"{vm_id}.mem", shared=True, owned=True)
        vm = await self._launch(vm_id, spec, memory, BootError, platform=None)
        async with _stopped_on_failure(vm, BootError, "boot failed"):
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
        try:
            disks, created = await _writable_tops(
                snapshot, target.workdir, f"boot-{secrets.token_hex(4)}"
            )
        except (layers.LayerError, KeyError, OSError) as exc:
            raise BootError(f"cannot create writable layers: {exc}") from exc
        net = target.net
        if snapshot.spec.net is not None and net is not None:
            net = dataclasses.replace(net, mac=snapshot.spec.net.mac)
        spec = dataclasses.replace(
            snapshot.spec,
            workdir=target.workdir,
            memory_dir=target.memory_dir,
            net=net,
            limits=target.limits,
            disks=tuple(disks),
            shares=target.shares,
        )
        try:
            vm = await self.boot(spec)
        except BaseException:
            _unlink(created)
            raise
        assert isinstance(vm, QemuVM)
        vm.owned_files += created
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

    async def load_saved(self, directory: Path) -> Snapshot:
        return await asyncio.to_thread(export.load, directory, self.name)

    async def restore(self, snapshot: Snapshot, target: RestoreSpec) -> VM:
        steps = Steps()
        vm = await self._restore_vm(snapshot, target, steps)
        async with _stopped_on_failure(vm, RestoreError, "restore failed"):
            await vm.monitor.execute("cont")
        vm.run_state = VMState.RUNNING
        steps.mark("cont")
        log.info("restored VM %s: %s", vm.id, steps)
        return vm

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
            await asyncio.to_thread(_unlink, [whole.state_file])
        return detached

    async def merge_layers(self, snapshot: Snapshot, directory: Path) -> Snapshot:
        """The chain composed as a restore would load it (`ramlayers.compose_into`), written
        into `directory/state`: one delta over the base memory file."""
        if not snapshot.layers:
            return snapshot
        state_file = directory / export.STATE
        states = (*snapshot.layers, snapshot.state_file)

        def merge() -> None:
            with open(state_file, "wb") as out:
                ramlayers.compose_into(states, RAM_BLOCK.encode(), out.fileno())

        try:
            await asyncio.to_thread(merge)
        except (OSError, ValueError) as exc:  # StreamFormatError is a ValueError
            await asyncio.to_thread(_unlink, [state_file])
            raise SnapshotError(f"cannot merge the memory layers: {exc}") from exc
        except BaseException:
            await asyncio.to_thread(_unlink, [state_file])
            raise
        return dataclasses.replace(snapshot, state_file=state_file, layers=())

    async def _whole_stream(self, snapshot: Snapshot, place: RestoreSpec) -> Snapshot:
        """`snapshot` with all of its RAM in a state stream of its own (in `place.memory_dir`)
        and no memory file: loaded and saved again, its manifest not written."""
        vm = await self._restore_vm(snapshot, place)
        stream = _memory_dir(vm.spec) / f"{vm.id}.whole"
        try:
            await vm.save_state(stream, ignore_shared=False)
        except (MonitorError, OSError) as exc:
            _unlink([stream])
            raise SnapshotError(f"cannot flatten memory: {exc}; {_tail(vm.stderr_log)}") from exc
        except BaseException:
            _unlink([stream])
            raise
        finally:
            await asyncio.shield(vm.stop())
        return dataclasses.replace(snapshot, state_file=stream, memory_file=None, layers=())

    async def _detach(
        self, snapshot: Snapshot, target: SnapshotTarget, place: RestoreSpec
    ) -> Snapshot:
        vm = await self._restore_vm(snapshot, place)
        made: list[Path] = []
        try:
            state_file = target.directory / "state"
            made.append(state_file)
            await vm.save_state(state_file, ignore_shared=True)
            memory_file = target.memory_dir / "memory"
            made.append(memory_file)
            await vm.hand_over_memory(memory_file)
        except (MonitorError, layers.LayerError, OSError) as exc:
            _unlink(made)
            raise SnapshotError(f"cannot detach memory: {exc}; {_tail(vm.stderr_log)}") from exc
        except BaseException:
            _unlink(made)
            raise
        finally:
            await asyncio.shield(vm.stop())
        detached = dataclasses.replace(snapshot, state_file=state_file, memory_file=memory_file)
        await asyncio.to_thread(detached.save_manifest)
        return detached

    async def _restore_vm(
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
        if not await asyncio.to_thread(target.workdir.is_dir):
            raise RestoreError(f"workdir {target.workdir} does not exist")
        net = snapshot.spec.net
        if (net is None) != (target.net is None):
            raise IncompatibleSnapshotError("the restore must have a network iff the source had")
        if target.net is not None and net is not None:
            # The guest driver's state holds the MAC: keep the source's, take the new location.
            net = dataclasses.replace(target.net, mac=net.mac)
        vm_id = secrets.token_hex(8)
        try:
            disks, created = await _writable_tops(snapshot, target.workdir, vm_id)
        except (layers.LayerError, KeyError) as exc:
            raise RestoreError(f"cannot create writable layers: {exc}") from exc
        steps.mark("check+tops")
        spec = dataclasses.replace(
            snapshot.spec,
            workdir=target.workdir,
            memory_dir=target.memory_dir,
            net=net,
            limits=target.limits,
            disks=tuple(disks),
            shares=target.shares,
        )
        _check_share_tags(spec, RestoreError)
        if snapshot.memory_file is not None:
            memory = _Memory(snapshot.memory_file, shared=False, owned=False)
        else:
            memory = _Memory(_memory_dir(spec) / f"{vm_id}.mem", shared=True, owned=True)
        try:
            vm = await self._launch(
                vm_id, spec, memory, RestoreError, platform=platform, steps=steps
            )
        except BaseException:
            _unlink(created)
            raise
        vm.owned_files += created
        async with _stopped_on_failure(vm, RestoreError, "restore failed"):
            if not memory.shared:
                await vm.monitor.execute(
                    "migrate-set-capabilities",
                    capabilities=[{"capability": "x-ignore-shared", "state": True}],
                )
                vm.ram_layers = await asyncio.to_thread(
                    ramlayers.chain, snapshot.layers, snapshot.state_file, spec.memory_mib << 20
                )
            if snapshot.layers:
                await self._load_layers(vm, snapshot)
            else:
                await vm.monitor.pass_file("state", snapshot.state_file, os.O_RDONLY)
                await vm.monitor.execute("migrate-incoming", uri="fd:state")
                await vm.monitor.wait_incoming(vm.proc, self.config.migrate_timeout_s)
        steps.mark("incoming")
        return vm

    async def _load_layers(self, vm: QemuVM, snapshot: Snapshot) -> None:
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
        await vm.monitor.wait_incoming(vm.proc, self.config.migrate_timeout_s)
        try:
            older = await asyncio.shield(composing)
        except ValueError as exc:  # a StreamFormatError, or a layer that is empty
            raise OSError(f"cannot compose the memory layers: {exc}") from exc
        log.info("restored VM %s from %d states, %d pages of older ones", vm.id, len(states), older)

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

    async def _check(self, snapshot: Snapshot) -> Platform:
        """Raises unless `snapshot` can be restored here; returns the platform to restore it on."""
        if not snapshot.machine_state:
            raise RestoreError("a filesystem-only snapshot cannot be restored: boot its disks")
        platform = await self._platform_of(snapshot)
        files = [snapshot.state_file, snapshot.spec.kernel, *snapshot.disks.values()]
        files += [p for p in (snapshot.memory_file, snapshot.spec.initrd) if p]
        files += [d.path for d in snapshot.spec.disks if d.read_only]
        files += snapshot.layers
        missing = [p for p in files if not await asyncio.to_thread(p.is_file)]
        if missing:
            raise RestoreError(f"snapshot is missing file(s): {', '.join(map(str, missing))}")
        return platform

    def _argv(
        self,
        vm_id: str,
        spec: VMSpec,
        memory: _Memory,
        qmp: Path,
        console: Path,
        tap_fd: int,
        platform: Platform,
        incoming: bool,
    ) -> list[str]:
        accel = "kvm" if self.config.accel == "kvm" else f"tcg,tb-size={self.config.tb_size_mib}"
        shared_memory = "on" if memory.shared else "off"
        jailed = self.config.jail is not None
        argv = [
            str(host_binary(self.config.binary)) if jailed else self.config.binary,
            "-name", f"{VMM_NAME_PREFIX}{vm_id}",  # lets the sweeps recognise our VMMs
            "-accel", accel,
            "-M", f"{platform.machine},memory-backend=mem",
            "-cpu", platform.cpu,
            "-smp", str(spec.vcpus),
            "-m", f"{spec.memory_mib}M",
            "-object",
            f"memory-backend-file,id=mem,size={spec.memory_mib}M,"
            f"mem-path={_opt(memory.path)},share={shared_memory}",
            "-display", "none",
            "-monitor", "none",
            "-no-reboot",
            "-no-user-config",
            # append=on: writes land at the file's end even after it was truncated (the
            # orchestrator caps console files, see orchestrator/consoles.py).
            "-chardev", f"file,id=con,path={_opt(console)},append=on",
            "-serial", "chardev:con",
            "-qmp", f"unix:{_opt(qmp)}",
            "-S",
        ]  # fmt: skip
        if not incoming:
            # A restored guest booted long ago: QEMU would hold a copy of the kernel and
            # initrd for the firmware (fw_cfg) all its life, ≈ 11 MiB a VMM, never read again.
            argv += ["-kernel", str(spec.kernel), "-append", spec.cmdline]
            if spec.initrd:
                argv += ["-initrd", str(spec.initrd)]
        if jailed:
            argv += ["-sandbox", SECCOMP]
        for disk in spec.disks:
            fmt = "qcow2" if qcow2.is_qcow2(disk.path) else "raw"
            ro = "on" if disk.read_only else "off"
            drive = f"id={disk.drive_id},file={_opt(disk.path)},format={fmt},if=none,readonly={ro}"
            argv += [
                "-drive", drive + self._discard(disk),
                "-device", f"virtio-blk-device,drive={disk.drive_id}",
            ]  # fmt: skip
        if spec.net:
            argv += [
                "-netdev", f"tap,id=net0,fd={tap_fd}",
                "-device", f"virtio-net-device,netdev=net0,mac={spec.net.mac}",
            ]  # fmt: skip
        empty = _empty_share() if spec.share_slots > len(spec.shares) else None
        for i in range(spec.share_slots):
            if i < len(spec.shares):
                fsdev = f"path={_opt(spec.shares[i].path)},{SHARE_FILE_MODES}"
            else:
                fsdev = f"path={_opt(empty)},security_model=none,readonly=on"
            argv += [
                "-fsdev", f"local,id=fs{i},{fsdev}",
                "-device", f"virtio-9p-device,fsdev=fs{i},mount_tag={share_tag(i)}",
            ]  # fmt: skip
        return argv

    def discard_options(self) -> dict[str, str]:
        """Options of a writable drive's top that give the host back what the guest frees: its
        discards (the guest mounts the drive with `discard`) punch holes in the top, and blocks
        it overwrites with zeros are unmapped rather than stored."""
        return {"discard": "unmap", "detect-zeroes": "unmap"} if self.config.discard else {}

    def _discard(self, disk: Disk) -> str:
        if disk.read_only:
            return ""
        return "".join(f",{key}={value}" for key, value in self.discard_options().items())

    def _jail_files(
        self, spec: VMSpec, memory: _Memory, qmp: Path, console: Path
    ) -> list[JailFile]:
        """What the VMM opens by path, with the access it needs (see `aenv.runtime.jail`).
        Blocking: reads disk headers."""
        files = [JailFile(p, Access.READ) for p in (spec.kernel, spec.initrd) if p]
        for disk in spec.disks:
            below = qcow2.chain(disk.path)
            if not disk.read_only:
                files.append(JailFile(below.pop(0), Access.OWN))
            files += [JailFile(p, Access.READ) for p in below]
        files += [JailFile(share.path, Access.SHARED_DIR) for share in spec.shares]
        if spec.share_slots > len(spec.shares):
            files.append(JailFile(EMPTY_SHARE, Access.READ))
        mapped = Access.OWN if memory.owned else Access.SHARED_WRITE
        return [*files, JailFile(memory.path, mapped), JailFile(qmp, Access.OWN),
                JailFile(console, Access.OWN)]  # fmt: skip

    def _limits(self, spec: VMSpec, memory: _Memory) -> CgroupLimits:
        lim = spec.limits
        tb_mib = self.config.tb_size_mib if self.config.accel == "tcg" else 0
        memory_mib = lim.memory_max_mib or _memory_cap_mib(spec.memory_mib, memory.shared, tb_mib)
        return CgroupLimits(
            memory_bytes=memory_mib << 20,
            pids=lim.pids_max or DEFAULT_PIDS,
            cpu_cores=lim.cpu_cores or float(spec.vcpus),
        )

    async def _launch(
        self,
        vm_id: str,
        spec: VMSpec,
        memory: _Memory,
        error: type[DriverError],
        *,
        platform: Platform | None,
        steps: Steps | None = None,
    ) -> QemuVM:
        """A QEMU process for `spec`, its vCPUs not started: a boot on our platform when
        `platform` is None, else waiting for an incoming state taken on `platform`. The time of
        each step goes into `steps`."""
        steps = steps or Steps()
        if not await asyncio.to_thread(spec.workdir.is_dir):
            raise error(f"workdir {spec.workdir} does not exist")
        qmp_path = spec.workdir / f"qmp.{vm_id}.sock"
        console = spec.workdir / f"console.{vm_id}.log"
        stderr_log = spec.workdir / f"qemu.{vm_id}.log"
        monitor = Monitor(qmp_path, f"aenv-{vm_id}")
        cgroup: Cgroup | None = None
        proc: asyncio.subprocess.Process | None = None
        tap_fd: int | None = None
        jail = self._new_jail()
        self._launching.add(vm_id)
        try:
            if spec.net is not None:
                tap_fd = await open_tap(spec.net.netns, spec.net.tap)
            steps.mark("tap")
            fd = -1 if tap_fd is None else tap_fd
            on = platform or self._platforms[0]
            argv = await asyncio.to_thread(
                self._argv, vm_id, spec, memory, qmp_path, console, fd, on, platform is not None
            )
            if platform is not None:
                argv += ["-incoming", "defer"]
            await monitor.listen()
            async with contextlib.AsyncExitStack() as held:
                if jail is not None:
                    argv = await self._confine(held, jail, argv, spec, memory, qmp_path, console)
                steps.mark("jail")
                proc = await _spawn(
                    argv, stderr_log, tap_fd, clean_env=jail is not None, shares=bool(spec.shares)
                )
                steps.mark("spawn")
                if self._cgroups is not None:
                    # Placed before the guest runs (-S): vCPU threads and helpers inherit it.
                    cgroup = await asyncio.to_thread(
                        self._cgroups.create,
                        self.cgroup_name(f"{VMM_NAME_PREFIX}{vm_id}"),
                        self._limits(spec, memory),
                    )
                    await asyncio.to_thread(cgroup.add, proc.pid)
                steps.mark("cgroup")
                # Connected means QEMU is running inside the jail: the jail may be let go.
                await monitor.accept(proc, self.config.start_timeout_s)
                steps.mark("qmp")
        except BaseException as exc:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
            await monitor.close()
            if cgroup is not None:
                await asyncio.to_thread(cgroup.remove)
            if memory.owned:
                _unlink([memory.path])
            self._release(jail)
            self._launching.discard(vm_id)
            if isinstance(exc, Exception):
                raise error(f"cannot start QEMU: {exc}; {_tail(stderr_log)}") from exc
            raise
        finally:
            if tap_fd is not None:
                os.close(tap_fd)
        vm = QemuVM(
            vm_id=vm_id,
            driver=self,
            platform=on,
            spec=spec,
            proc=proc,
            monitor=monitor,
            memory=memory,
            cgroup=cgroup,
            jail=jail,
            console_log=console,
            stderr_log=stderr_log,
        )
        self._vms[vm_id] = vm
        self._launching.discard(vm_id)  # only now: a reaper thread sees it owned all along
        return vm

    async def _confine(
        self,
        held: contextlib.AsyncExitStack,
        jail: Jail,
        argv: list[str],
        spec: VMSpec,
        memory: _Memory,
        qmp: Path,
        console: Path,
    ) -> list[str]:
        """`argv` run inside `jail`, whose namespaces `held` keeps until QEMU has joined them."""
        # Files QEMU would create itself are made first, so that they can be given to it.
        made = [console, memory.path] if memory.owned else [console]
        await asyncio.to_thread(_touch, made)
        files = await asyncio.to_thread(self._jail_files, spec, memory, qmp, console)
        return [*await held.enter_async_context(jail.assemble(files)), *argv]

    def _new_jail(self) -> Jail | None:
        if self.config.jail is None or self._uids is None:
            return None
        return Jail(self._uids.acquire(), self.config.jail.gid, kvm=self.config.accel == "kvm")

    def _release(self, jail: Jail | None) -> None:
        """Give the uid of a jail whose process has exited back."""
        if jail is not None and self._uids is not None:
            self._uids.release(jail.uid)


class QemuVM:
    """One QEMU process. Operations on one VM are serialised by a lock."""

    def __init__(
        self,
        *,
        vm_id: str,
        driver: QemuDriver,
        platform: Platform,
        spec: VMSpec,
        proc: asyncio.subprocess.Process,
        monitor: Monitor,
        memory: _Memory,
        cgroup: Cgroup | None,
        jail: Jail | None,
        console_log: Path,
        stderr_log: Path,
    ) -> None:
        self._id = vm_id
        self._driver = driver
        self.platform = platform
        self.spec = spec
        self.proc = proc
        self.monitor = monitor
        self.memory = memory
        self.cgroup = cgroup
        self.jail = jail
        self._console = console_log
        self.stderr_log = stderr_log
        self.run_state = VMState.PAUSED
        self.owned_files: list[Path] = []  # private writable layers created for this VM
        # The saved states whose memory this VM was restored from over its mapped file, oldest
        # first: its next save keeps only what differs from them (`ramlayers`).
        self.ram_layers: tuple[Path, ...] = ()
        self._lock = asyncio.Lock()
        self._generation = 0

    @property
    def id(self) -> str:
        return self._id

    @property
    def state(self) -> VMState:
        if self.proc.returncode is not None:
            return VMState.STOPPED
        return self.run_state

    @property
    def console_log(self) -> Path:
        return self._console

    @property
    def share_slots(self) -> int:
        return self.spec.share_slots

    def _require(self, *states: VMState) -> None:
        if self.state not in states:
            raise DriverError(f"VM {self._id} is {self.state.value}")

    async def pause(self) -> None:
        async with self._lock:
            self._require(VMState.RUNNING, VMState.PAUSED)
            await self.monitor.execute("stop")
            self.run_state = VMState.PAUSED

    async def resume(self) -> None:
        async with self._lock:
            self._require(VMState.RUNNING, VMState.PAUSED)
            await self.monitor.execute("cont")
            self.run_state = VMState.RUNNING

    async def snapshot(
        self, target: SnapshotTarget, *, keep_running: bool, machine_state: bool = True
    ) -> Snapshot:
        async with self._lock:
            self._require(VMState.RUNNING, VMState.PAUSED)
            was_running = self.run_state is VMState.RUNNING
            made: list[Path] = []
            try:
                snap = await self._snapshot(target, keep_running, made, machine_state)
            except (MonitorError, layers.LayerError, OSError, ramdelta.StreamFormatError) as exc:
                _unlink(made)
                if self.state is not VMState.STOPPED and was_running:
                    with contextlib.suppress(MonitorError):
                        await self.monitor.execute("cont")
                        self.run_state = VMState.RUNNING
                raise SnapshotError(f"snapshot failed: {exc}; {_tail(self.stderr_log)}") from exc
            if keep_running and was_running:
                await self.monitor.execute("cont")
                self.run_state = VMState.RUNNING
        if not keep_running:
            await self.stop()
        return snap

    async def _snapshot(
        self, target: SnapshotTarget, keep_running: bool, made: list[Path], machine_state: bool
    ) -> Snapshot:
        steps = Steps()
        if self.run_state is VMState.RUNNING:
            await self.monitor.execute("stop")
            self.run_state = VMState.PAUSED
        steps.mark("stop")
        # vm_stop has drained and flushed every drive, so the files are consistent now.
        spec = self.spec
        sealed: dict[str, Path] = {}
        for disk in spec.disks:
            if not disk.read_only:
                sealed[disk.drive_id] = await self._seal(disk, target.directory, made)
        if keep_running:
            await self._restack(sealed)
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
                await self._quit()
        elif self.memory.shared:
            await self.save_state(state_file, ignore_shared=True)
            memory_file = target.memory_dir / "memory"
            made.append(memory_file)
            if keep_running:
                await layers.sparse_copy(self.memory.path, memory_file)
            else:
                await self.hand_over_memory(memory_file)
        elif not keep_running:
            # Only what changed since the memory file it maps; that file stays the base.
            ram_layers = await self.save_layered(state_file)
            memory_file = self.memory.path
            await self._quit()
        else:
            # Only what changed since the memory file it maps, as a pause. Snapshots and fork
            # checkpoints outlive the base's owner and are exported with their files moved:
            # the snapshot gets the base as a hard link of its own (no bytes written; the
            # file is never written again), copied only when `memory_dir` is elsewhere.
            ram_layers = await self.save_layered(state_file)
            memory_file = target.memory_dir / "memory"
            made.append(memory_file)
            await export.place(self.memory.path, memory_file, move=False)
        steps.mark("state")
        for dest in sealed.values():
            await qcow2.flatten_if_deep(dest)
        steps.mark("flatten")
        snap = Snapshot(
            driver=self._driver.name,
            compat=await self._driver.compat_on(self.platform),
            spec=spec,
            state_file=state_file,
            memory_file=memory_file,
            disks=sealed,
            machine_state=machine_state,
            layers=ram_layers,
        )
        await asyncio.to_thread(snap.save_manifest)
        steps.mark("manifest")
        log.info("snapshot of VM %s: %s", self._id, steps)
        return snap

    async def save_state(self, state_file: Path, *, ignore_shared: bool) -> None:
        """Write the (stopped) VM's device state, and its RAM unless `ignore_shared`, as a
        migration stream into `state_file`."""
        await self._migrate_prepare(ignore_shared)
        await self.monitor.pass_file("state", state_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        await self._migrate()

    async def _migrate_prepare(self, ignore_shared: bool) -> None:
        await self.monitor.execute(
            "migrate-set-capabilities",
            capabilities=[{"capability": "x-ignore-shared", "state": ignore_shared}],
        )
        await self.monitor.execute("migrate-set-parameters", **{"max-bandwidth": MIGRATE_BANDWIDTH})

    async def _migrate(self) -> None:
        await self.monitor.execute("migrate", uri="fd:state")
        await self.monitor.wait_migration(self.proc, self._driver.config.migrate_timeout_s)

    async def save_layered(self, state_file: Path) -> tuple[Path, ...]:
        """`save_delta` over the states this VM was restored from (`ram_layers`): returns the
        layers the new state lies over (`Snapshot.layers`), `()` when it is a delta against the
        base (no chain, one that cannot be read any more, or a stream kept whole)."""
        parent: ramlayers.Chain | None = None
        if self.ram_layers:
            try:
                parent = await asyncio.to_thread(
                    ramlayers.Chain, self.ram_layers, RAM_BLOCK.encode()
                )
            except (OSError, ValueError) as exc:  # StreamFormatError is a ValueError
                log.warning("saving VM %s against its base: its layers: %s", self._id, exc)
        try:
            stats = await self.save_delta(state_file, parent)
            return parent.holding_pages() if parent is not None and stats is not None else ()
        finally:
            if parent is not None:
                parent.close()

    async def save_delta(
        self, state_file: Path, parent: ramlayers.Chain | None = None
    ) -> ramdelta.DeltaStats | None:
        """Write the (stopped) VM's device state and the pages it changed in its privately
        mapped memory file as a migration stream into `state_file` (see `ramdelta`). Once this
        driver's QEMU has shown that the filter understands its streams, QEMU migrates into a
        pipe that the filter reads as it goes; until then (the first save of each server) QEMU
        writes its whole stream into a scratch file beside the memory (tmpfs) and a stream the
        filter does not understand is kept whole (None), which restores all the same."""
        started = time.perf_counter()
        keep = await asyncio.to_thread(ramdelta.changed_pages, self.proc.pid, self.memory.path)
        same: ramdelta.Same | None = None
        if parent is not None:
            # The chain's pages too: one the VMM gave back to its file (a discard) differs.
            keep = keep.union(parent.where)
            same = parent.same
        mapped = time.perf_counter()
        stats: ramdelta.DeltaStats | None
        if self._driver.streams_understood:
            stats = await self._save_through_filter(state_file, keep, same)
        else:
            stats = await self._save_then_filter(state_file, keep, same)
            self._driver.streams_understood = stats is not None
        if stats is not None:
            log.info(
                "saved VM %s: page map %.0f ms, stream %.0f ms, kept %d of %d bytes",
                self._id,
                (mapped - started) * 1e3,
                (time.perf_counter() - mapped) * 1e3,
                stats.bytes_out,
                stats.bytes_in,
            )
        return stats

    async def _save_through_filter(
        self, state_file: Path, keep: frozenset[int], same: ramdelta.Same | None
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
                await self._migrate_prepare(ignore_shared=True)
                await self.monitor.pass_fd("state", write)
            finally:
                os.close(write)  # QEMU holds the only write end now: its close ends the stream
            try:
                await self._migrate()
            except BaseException:
                # A migration that never started leaves the fd with QEMU; closing it ends the
                # filter's read. One that started closed it when it failed.
                with contextlib.suppress(MonitorError):
                    await self.monitor.execute("closefd", fdname="state")
                raise
            # Shielded: cancelling the thread's task would not stop the thread.
            return await asyncio.shield(filtering)
        except ramdelta.StreamFormatError:
            self._driver.streams_understood = False
            raise

    async def _save_then_filter(
        self, state_file: Path, keep: frozenset[int], same: ramdelta.Same | None
    ) -> ramdelta.DeltaStats | None:
        scratch = _memory_dir(self.spec) / f"{self._id}.stream"
        try:
            await self.save_state(scratch, ignore_shared=True)
            try:
                return await asyncio.to_thread(
                    ramdelta.filter_file, scratch, state_file, RAM_BLOCK, keep, same
                )
            except ramdelta.StreamFormatError as exc:
                log.warning("saving VM %s with all of its RAM: %s", self._id, exc)
                await export.place(scratch, state_file, move=True)
                return None
        finally:
            await asyncio.to_thread(_unlink, [scratch])

    async def hand_over_memory(self, dest: Path) -> None:
        """Quit QEMU and give its (shared, owned) memory file the name `dest`."""
        await self._quit()
        await export.place(self.memory.path, dest, move=True)
        self.memory = dataclasses.replace(self.memory, owned=False)

    async def _seal(self, disk: Disk, directory: Path, made: list[Path]) -> Path:
        """Give the drive's current top its permanent name in the snapshot directory. Layers are
        only ever referenced by such names, never by a VM's workdir, which goes away with it."""
        ext = "qcow2" if await asyncio.to_thread(qcow2.is_qcow2, disk.path) else "img"
        dest = directory / f"{disk.drive_id}.{ext}"
        made.append(dest)
        return await layers.seal(disk.path, dest)

    async def _restack(self, sealed: dict[str, Path]) -> None:
        """Continue each writable drive on a new empty top over its sealed layer. The top is made
        by us (`mode=existing`) so that its header names the sealed layer, not the workdir file."""
        self._generation += 1
        disks: list[Disk] = []
        for disk in self.spec.disks:
            if disk.read_only:
                disks.append(disk)
                continue
            top = self.spec.workdir / f"{disk.drive_id}.{self._id}.{self._generation}.qcow2"
            await qcow2.overlay(sealed[disk.drive_id], top)
            self.owned_files.append(top)
            if self.jail is not None:
                await self.jail.expose(self.proc.pid, JailFile(top, Access.OWN))
            await self._stack(disk.drive_id, top)
            disks.append(Disk(disk.drive_id, top, read_only=False))
            # Record each switch at once: if a later drive fails, the spec still says where
            # every drive is now.
            self.spec = dataclasses.replace(
                self.spec, disks=tuple(disks) + self.spec.disks[len(disks) :]
            )

    async def _stack(self, drive_id: str, top: Path) -> None:
        """Put `top` over the drive's current top, which becomes its backing layer. Added as a
        node of its own first (not `blockdev-snapshot-sync`, whose new node gets default options):
        the new top must pass discards and unmap zeros as the drive's first one does. Its header
        is left as we wrote it, naming the sealed layer."""
        node = f"{drive_id}-{self._generation}"
        await self.monitor.execute(
            "blockdev-add",
            **{
                "driver": "qcow2",
                "node-name": node,
                "file": {"driver": "file", "filename": str(top)},
                "backing": None,  # the drive's current top, given by blockdev-snapshot
                **self._driver.discard_options(),
            },
        )
        try:
            await self.monitor.execute("blockdev-snapshot", node=drive_id, overlay=node)
        except MonitorError:
            with contextlib.suppress(MonitorError):
                await self.monitor.execute("blockdev-del", **{"node-name": node})
            raise

    async def _quit(self) -> None:
        with contextlib.suppress(MonitorError):
            await self.monitor.execute("quit")
        await self.proc.wait()

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
        self._driver._release(self.jail)
        self.jail = None
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.remove)
            self.cgroup = None
        files = list(self.owned_files)
        if self.memory.owned:
            files.append(self.memory.path)
        await asyncio.to_thread(_unlink, files)
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
async def _stopped_on_failure(
    vm: QemuVM, error: type[DriverError], what: str
) -> AsyncIterator[None]:
    """Stop `vm` when the block fails in any way, cancellation included: a VMM nobody holds
    any more would run on. QEMU's and the OS's errors become `error`; the stop is shielded, so
    a second cancellation cannot cut it short."""
    try:
        yield
    except (MonitorError, OSError) as exc:
        await asyncio.shield(vm.stop())
        raise error(f"{what}: {exc}; {_tail(vm.stderr_log)}") from exc
    except BaseException:
        await asyncio.shield(vm.stop())
        raise


def _check_share_tags(spec: VMSpec, error: type[DriverError]) -> None:
    """Shares must carry their slots' tags (`share_tag`): the guest knows its devices by them."""
    wrong = [s.tag for i, s in enumerate(spec.shares) if s.tag != share_tag(i)]
    if wrong:
        raise error(f"share tags {wrong} are not their slots' ({share_tag(0)}, ...)")


def _empty_share() -> Path:
    """`EMPTY_SHARE`, made if missing (blocking)."""
    EMPTY_SHARE.mkdir(mode=0o755, parents=True, exist_ok=True)
    return EMPTY_SHARE


def _memory_cap_mib(guest_mib: int, shared: bool, tb_mib: int) -> int:
    """What a VMM's cgroup may hold. A VMM owning its memory file holds the guest's RAM once
    (the file's tmpfs pages) besides its own overhead and translation cache (`tb_mib`). One
    mapping a base file privately can be charged for the guest's RAM three times over, each
    bounded by the guest's size: its private copies of the pages the guest wrote; the pages
    tmpfs allocates in the base file where the guest touched a hole (a private mapping of a
    sparse tmpfs file fills the hole before copying it, and the filled page stays in the file,
    unreclaimable without swap); and while it saves changed pages, the stream it writes into
    tmpfs scratch (`save_delta`: the first such save of a server; later ones stream through a
    pipe, but any VMM may be first). A cap of guest + overhead killed such VMMs once their guest
    had written most of its RAM."""
    return (1 if shared else 3) * guest_mib + VMM_OVERHEAD_MIB + tb_mib


UNNAMED_MACHINE = "microvm,x-option-roms=off,rtc=on"  # of snapshots whose compat names none
# The CPU of TCG guests: all TCG emulates, but 4-level paging. Given LA57 the guest kernel uses
# 5-level page tables: one more level for every page walk of the emulated MMU, and TCG walks on
# every miss of its software TLB, which it flushes whole at every address-space switch. The
# same guest work costs 6% less host CPU without it (bench/guest_cpu.py), 14% over a longer
# run of SDK commands on one sandbox (docs/benchmarks.md). Guests keep 128 TiB of user space.
TCG_CPU = "max,la57=off"
LEGACY_TCG_CPU = "max"  # of snapshots taken before 2026-12-05


@dataclass(frozen=True)
class Platform:
    """What the state of a VM depends on besides its spec: the CPU model its VMM emulates (or
    passes through) and the machine with its devices. A snapshot restores only on the platform
    it was taken on (its `compat` names it), so a driver keeps restoring older ones."""

    cpu: str
    machine: str


def _platforms(accel: str) -> tuple[Platform, ...]:
    """The platforms `accel` restores, newest (the one it boots) first."""
    if accel != "tcg":
        return (Platform("host", _machine(accel)), Platform("host", UNNAMED_MACHINE))
    return (
        Platform(TCG_CPU, _machine(accel)),
        Platform(LEGACY_TCG_CPU, _machine(accel)),
        Platform(LEGACY_TCG_CPU, UNNAMED_MACHINE),
    )


def _machine(accel: str) -> str:
    """The machine and its devices; a snapshot restores only on the same (its `compat` names
    them). Under TCG without the PIT: nothing in the guest uses it (the local APIC is its
    timer), yet QEMU emulated its default 18.2 Hz square wave, waking every VMM's main loop
    36 times a second (most of an idle sandbox's host CPU once the guest itself was quiet,
    docs/density.md). Under KVM the PIT is in the kernel and costs the host no wakeups."""
    pit = ",pit=off" if accel == "tcg" else ""
    return f"microvm,x-option-roms=off,rtc=on{pit}"


def _memory_dir(spec: VMSpec) -> Path:
    return spec.memory_dir or spec.workdir


def _host_cpu_model() -> str:
    match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    return match.group(1).strip() if match else "unknown"


async def _spawn(
    argv: Sequence[str], stderr_log: Path, tap_fd: int | None, *, clean_env: bool, shares: bool
) -> asyncio.subprocess.Process:
    with stderr_log.open("wb") as err:
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,  # one process group: kill takes any helper too
            pass_fds=() if tap_fd is None else (tap_fd,),
            # A jailed VMM gets none of the server's environment (it may hold credentials).
            env=_JAIL_ENV if clean_env else None,
            # Files a VMM creates in a share get exactly `SHARE_FILE_MODES` (see `_argv`).
            umask=0 if shares else -1,
        )


def _touch(paths: Sequence[Path]) -> None:
    for p in paths:
        p.touch()


async def _writable_tops(
    snapshot: Snapshot, workdir: Path, tag: str
) -> tuple[list[Disk], list[Path]]:
    """`snapshot`'s drives for a new VM: shared read-only drives as they are, and a fresh qcow2
    top in `workdir` over each sealed writable layer. Returns the drives and the tops made; a
    failure removes the tops made so far and propagates."""
    disks: list[Disk] = []
    created: list[Path] = []
    try:
        for disk in snapshot.spec.disks:
            if disk.read_only:
                disks.append(disk)
                continue
            top = workdir / f"{disk.drive_id}.{tag}.qcow2"
            await qcow2.overlay(snapshot.disks[disk.drive_id], top)
            created.append(top)
            disks.append(Disk(disk.drive_id, top))
    except BaseException:
        _unlink(created)
        raise
    return disks, created


def _unlink(paths: Sequence[Path]) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
