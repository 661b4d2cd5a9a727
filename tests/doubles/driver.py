"""A VMM driver without VMs, for tests of everything above `runtime/`: it keeps the driver
contract (`runtime/driver.py`) and its file formats are checked, but a "VM" is a `Guest` and an
in-process envd double serving on its slot's address.

What it keeps real: snapshot files on disk (device state, a memory file, sealed raw disk images,
copied for cold boots and linked by exports as a driver without a layered format does), restores
that fail on missing or foreign files, filesystem-only saves that lose what the guest did not
flush, VMMs that exit on their own (`DoubleVM.crash`). Tests steer it: `fail_next("restore")`
makes the next restore fail, `hold("snapshot")` stops the next snapshot half-way until released.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import secrets
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import uvicorn

from aenv.runtime import export, qcow2
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
)
from aenv.storage import layers
from tests.doubles.guest import Guest, envd_app
from tests.doubles.slots import DoubleSlots
from tests.support import loopback_api

NAME = "double"
DISK_MAGIC = b"AENV-DOUBLE-DISK\n"
DISK_BLOCK = 64 << 10
_ERRORS: dict[str, type[DriverError]] = {
    "boot": BootError,
    "restore": RestoreError,
    "snapshot": SnapshotError,
}


def write_disk(path: Path, files: dict[str, str]) -> Path:
    """A raw disk image holding `files`, padded to whole blocks as a real image is."""
    data = DISK_MAGIC + json.dumps(files, sort_keys=True).encode()
    path.write_bytes(data + b"\0" * (-len(data) % DISK_BLOCK))
    return path


async def read_disk(path: Path) -> dict[str, str]:
    """The files on a raw disk image (an empty ext4 layer holds none). Another driver's format
    is refused: this driver never makes one."""
    if await asyncio.to_thread(qcow2.is_qcow2, path):
        raise RestoreError(f"{path} is a qcow2 image; the double reads raw images only")
    return _files(await asyncio.to_thread(_head, path))


def _head(path: Path) -> bytes:
    with path.open("rb") as fh:
        return fh.read(DISK_BLOCK * 16)


def _files(data: bytes) -> dict[str, str]:
    if not data.startswith(DISK_MAGIC):
        return {}
    files: dict[str, str] = json.loads(data[len(DISK_MAGIC) :].rstrip(b"\0"))
    return files


@dataclasses.dataclass
class Hold:
    """An operation stopped half-way: `reached` is set when it gets there, `release()` lets
    it go on."""

    reached: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    gate: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def release(self) -> None:
        self.gate.set()


class DoubleDriver:
    def __init__(self, slots: DoubleSlots) -> None:
        self.slots = slots
        self.running: dict[str, DoubleVM] = {}
        self.calls: collections.Counter[str] = collections.Counter()
        self._failures: collections.Counter[str] = collections.Counter()
        self._holds: dict[str, Hold] = {}
        # What `no_shares` answers: set it to play a driver without shares (Firecracker).
        self.shares_refused: str | None = None
        # Share devices of every booted VM, as QEMU's (`VMSpec.share_slots`); 0 plays VMs
        # booted before share slots came.
        self.share_slots = 2

    @property
    def name(self) -> str:
        return NAME

    def fail_next(self, operation: str, times: int = 1) -> None:
        self._failures[operation] += times

    def hold(self, operation: str) -> Hold:
        hold = Hold()
        self._holds[operation] = hold
        return hold

    async def step(self, operation: str) -> None:
        """Where each operation can be held or made to fail (before it changed anything)."""
        self.calls[operation] += 1
        hold = self._holds.pop(operation, None)
        if hold is not None:
            hold.reached.set()
            await hold.gate.wait()
        if self._failures[operation] > 0:
            self._failures[operation] -= 1
            raise _ERRORS[operation](f"{operation} failed (injected)")

    @property
    def no_shares(self) -> str | None:
        return self.shares_refused

    def kernel_image(self, kernel: KernelImages) -> Path:
        return kernel.bzimage

    async def boot(self, spec: VMSpec) -> VM:
        await self.step("boot")
        return await self._boot(spec)

    def _with_slots(self, spec: VMSpec) -> VMSpec:
        slots = max(spec.share_slots, self.share_slots, len(spec.shares))
        return dataclasses.replace(spec, share_slots=slots)

    async def boot_saved(self, snapshot: Snapshot, target: RestoreSpec) -> VM:
        await self.step("boot")
        if snapshot.driver != NAME:
            raise IncompatibleSnapshotError(f"a {snapshot.driver} snapshot")
        run = secrets.token_hex(4)
        disks = []
        for disk in snapshot.spec.disks:
            if disk.read_only:
                disks.append(disk)
                continue
            layer = target.workdir / f"{disk.drive_id}.boot-{run}.img"
            await layers.sparse_copy(snapshot.disks[disk.drive_id], layer)
            disks.append(Disk(disk.drive_id, layer))
        net = target.net
        if net is not None and snapshot.spec.net is not None:
            net = dataclasses.replace(net, mac=snapshot.spec.net.mac)
        spec = dataclasses.replace(
            snapshot.spec,
            workdir=target.workdir,
            net=net,
            memory_dir=target.memory_dir,
            disks=tuple(disks),
            shares=target.shares,
        )
        return await self._boot(spec)

    async def export(
        self, snapshot: Snapshot, dest: Path, *, move: bool, memory_dir: Path | None = None
    ) -> Snapshot:
        await self.step("export")

        async def place(drive_id: str, source: Path) -> Path:
            image = dest / f"{drive_id}.img"
            await export.place(source, image, move=move)
            return image

        return await export.export(snapshot, dest, move=move, disk=place, memory_dir=memory_dir)

    async def load_saved(self, directory: Path, *, unread: Collection[Path] = ()) -> Snapshot:
        return await asyncio.to_thread(export.load, directory, NAME, unread)

    async def _boot(self, spec: VMSpec) -> VM:
        files: dict[str, str] = {}
        for disk in spec.disks:  # in order, each layer's files over those below, as restores do
            if not disk.path.is_file():
                raise BootError(f"disk {disk.drive_id}: no file {disk.path}")
            files |= await read_disk(disk.path)
        return await self._start(self._with_slots(spec), Guest.booted(files))

    async def restore(self, snapshot: Snapshot, target: RestoreSpec) -> VM:
        await self.step("restore")
        if snapshot.driver != NAME:
            raise IncompatibleSnapshotError(f"a {snapshot.driver} snapshot")
        if len(target.shares) > snapshot.spec.share_slots:
            raise RestoreError("a restored VM has its snapshot's devices: shares need a boot")
        if target.lazy_memory is not None:
            raise RestoreError("the double reads its memory file; it takes no memory source")
        if not snapshot.machine_state or snapshot.memory_file is None:
            raise RestoreError("a filesystem-only snapshot cannot be restored, only booted")
        try:
            # In a thread: a VMM is another process, and a lazily served file's reads are
            # answered on this event loop.
            json.loads(await asyncio.to_thread(snapshot.state_file.read_text))
            memory: dict[str, Any] = json.loads(
                await asyncio.to_thread(snapshot.memory_file.read_text)
            )
            files: dict[str, str] = {}
            for path in snapshot.disks.values():
                files |= await read_disk(path)
        except (OSError, ValueError) as e:
            raise RestoreError(f"unreadable snapshot: {e}") from e
        spec = dataclasses.replace(
            snapshot.spec,
            workdir=target.workdir,
            net=target.net,
            memory_dir=target.memory_dir,
            shares=target.shares,
        )
        return await self._start(spec, Guest.restored(memory, files))

    async def restore_many(self, snapshot: Snapshot, targets: Sequence[RestoreSpec]) -> list[VM]:
        results = await asyncio.gather(
            *(self.restore(snapshot, t) for t in targets), return_exceptions=True
        )
        vms = [r for r in results if isinstance(r, DoubleVM)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for vm in vms:
                await vm.stop()
            raise errors[0]
        return list(vms)

    async def detach_memory(
        self,
        snapshot: Snapshot,
        target: SnapshotTarget,
        place: RestoreSpec,
        *,
        flatten: bool = False,
    ) -> Snapshot:
        return snapshot  # the memory is a file already

    async def merge_layers(self, snapshot: Snapshot, directory: Path) -> Snapshot:
        return snapshot  # saved whole: no layers

    async def _start(self, spec: VMSpec, guest: Guest) -> DoubleVM:
        if spec.net is None or spec.net.netns not in self.slots.sockets:
            raise BootError("no network slot to serve envd on")
        vm = DoubleVM(self, spec, guest)
        await vm.start(self.slots.sockets[spec.net.netns])
        self.running[vm.id] = vm
        return vm


class DoubleVM:
    def __init__(self, driver: DoubleDriver, spec: VMSpec, guest: Guest) -> None:
        self.driver = driver
        self.spec = spec
        self.guest = guest
        self._id = secrets.token_hex(6)
        self._state = VMState.RUNNING
        self._exited = asyncio.Event()
        self._seq = 0
        # The VMM's CPU time: nothing runs on the host for a double, so a test says what the
        # guest did by adding to it.
        self.cpu_seconds = 0.0
        self._started = time.time()
        config = uvicorn.Config(envd_app(guest), lifespan="off", log_level="warning")
        config.load()
        self._server = uvicorn.Server(config)
        self._server.lifespan = config.lifespan_class(config)

    @property
    def id(self) -> str:
        return self._id

    @property
    def state(self) -> VMState:
        return self._state

    @property
    def console_log(self) -> Path:
        return self.spec.workdir / f"console-{self._id}.log"

    @property
    def share_slots(self) -> int:
        return self.spec.share_slots

    async def start(self, sock: Any) -> None:
        await self._server.startup(sockets=[sock])
        self.console_log.write_text(f"double VM {self._id} up\n")

    async def pause(self) -> None:
        self._state = VMState.PAUSED

    async def resume(self) -> None:
        self._state = VMState.RUNNING

    async def snapshot(
        self, target: SnapshotTarget, *, keep_running: bool, machine_state: bool = True
    ) -> Snapshot:
        await self.driver.step("snapshot")
        if self._state is VMState.STOPPED:
            raise SnapshotError(f"VM {self._id} is not running")
        if machine_state and self.guest.volumes_mounted:
            raise SnapshotError("QEMU cannot save a mounted 9p share's state")
        self._seq += 1
        disks = {}
        for disk in self.spec.disks:
            if not disk.read_only:
                path = target.directory / f"{disk.drive_id}-{self._id}-{self._seq}.img"
                disks[disk.drive_id] = write_disk(path, self.guest.disk)
                path.chmod(0o444)
        state = target.directory / "state"
        memory = None
        if machine_state:
            state.write_text(json.dumps({"driver": NAME, "vm": self._id}))
            memory = target.memory_dir / "memory"
            memory.write_text(json.dumps(self.guest.memory()))
        else:
            state.write_bytes(b"")
        if not keep_running:
            await self.stop()
        snapshot = Snapshot(NAME, "double-1", self.spec, state, memory, disks, machine_state)
        snapshot.save_manifest()  # last, as the real drivers do: it makes the snapshot complete
        return snapshot

    async def stop(self) -> None:
        if self._state is VMState.STOPPED:
            return
        await self.driver.step("stop")
        self._state = VMState.STOPPED
        await loopback_api.stop(self._server)
        self.driver.running.pop(self._id, None)
        self._exited.set()

    async def crash(self) -> None:
        """The VMM dies on its own (an OOM kill, a kill -9 from outside)."""
        await self.stop()

    async def wait_exit(self) -> None:
        await self._exited.wait()

    async def stats(self) -> VMStats:
        return VMStats(cpu_seconds=self.cpu_seconds, rss_bytes=0, pss_bytes=0, disk_bytes=0)

    def cpu_time(self) -> CPUTime:
        if self._state is VMState.STOPPED:
            raise DriverError(f"VM {self._id} is stopped")
        return CPUTime(self.cpu_seconds, self._started)
