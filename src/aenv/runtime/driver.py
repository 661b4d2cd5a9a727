"""The one async interface every VMM driver implements (qemu, firecracker, later others).

Owns the vocabulary shared by drivers and their callers: what a VM is made of (`VMSpec`), what a
snapshot is (`Snapshot`), how a restore is placed (`RestoreSpec`), what can go wrong
(`DriverError` and subclasses), and the two protocols `Driver` and `VM`.

Contract, for implementers:

- A driver owns `workdir` of every VM it starts for the VM's lifetime: sockets, logs, the guest
  memory file and the private writable disk layers of restored VMs live there. `VM.stop()` kills
  the VMM process, releases its cgroup and deletes the memory and disk files the driver created;
  logs stay for diagnosis, and the caller removes `workdir` itself.
- Every operation either completes or raises a `DriverError` after undoing what it started: no
  VMM process, cgroup or half-written file is left behind by a failed `boot`/`restore`.
- `boot` and `restore` return once the guest is *running*. Readiness of anything inside the guest
  (envd) is the caller's business, as is calling envd `/init` after every restore: clones of one
  snapshot share RNG state and boot_id until then.
- Disks: `Disk.read_only` drives (template base image, envd bundle) are shared and never copied.
  Writable drives are frozen by `VM.snapshot` into sealed, read-only images listed in
  `Snapshot.disks`; `restore` and `boot_saved` give each VM a private writable layer on top of
  them. The format of sealed and private layers is the driver's own: callers never read, write
  or create a disk layer themselves, they only move whole saved states with `export`.
- Saved states: `export` makes a directory that depends on nothing else of the host but the
  read-only drives and the kernel (a snapshot's layers may refer to earlier ones by path); such a
  directory may be copied away and back to the same path, and `load_saved` reads it again.
- Memory on demand: a restore may be given the snapshot's guest memory as a source read page by
  page (`RestoreSpec.lazy_memory`) when the node lacks `Snapshot.memory_file`. A driver whose
  VMM can take its memory that way serves each page the guest touches from it, for the VM's
  life; a page the source cannot give stops the VM (never a wrong page), after telling the
  caller. A driver that cannot refuses such a restore (`RestoreError`).
- Nothing above `runtime/` may assume the sandbox is a VM: callers use only this module.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import psutil

from aenv import atomic
from aenv.runtime import checksums
from aenv.runtime.checksums import Checksum

SNAPSHOT_MANIFEST = "snapshot.json"
# What `snapshot.json` starts with, as a snapshot header's magic and version do. Version 1
# (no `format`, no checksums) is what manifests written before both were; version 2 adds
# `files`, the checksum of every file the manifest names.
MANIFEST_FORMAT = "aenv-saved-state"
MANIFEST_VERSION = 2


class DriverError(RuntimeError):
    """A VMM operation failed; resources it started were released before raising."""


class BootError(DriverError):
    """The VMM could not start the guest (missing kernel, bad disk, VMM crashed)."""


class SnapshotError(DriverError):
    """Saving memory, device state or disks failed; the source VM is left as it was."""


class RestoreError(DriverError):
    """Loading a snapshot failed (missing or corrupt files, VMM rejected the state)."""


class CorruptSavedState(RestoreError):
    """A file of a saved state differs from what its manifest recorded; nothing was changed."""


class UnknownSavedStateFormat(RestoreError):
    """A manifest of another program, or of a format version this code cannot read."""


class IncompatibleSnapshotError(RestoreError):
    """The snapshot was taken by another driver, VMM version, accelerator or CPU model."""


class VMState(enum.StrEnum):
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"


@dataclass(frozen=True)
class KernelImages:
    """One guest kernel build in each form a VMM loads; `Driver.kernel_image` picks its own."""

    bzimage: Path  # compressed, self-decompressing
    vmlinux: Path  # the uncompressed ELF


@dataclass(frozen=True)
class Disk:
    """A block device. `drive_id` is stable across snapshot and restore (it names the device)."""

    drive_id: str
    path: Path
    read_only: bool = False


@dataclass(frozen=True)
class Share:
    """A host directory the guest can mount read-write by `tag` (a volume). Several VMs may
    share one directory at once and see each other's writes. A VM cannot be snapshotted with
    its memory while its guest has a share mounted (QEMU saves no mounted 9p device), and
    drivers whose VMM has no shared-filesystem device refuse them (`BootError`). The `i`-th
    share of a VM is named `share_tag(i)`."""

    tag: str
    path: Path


def share_tag(index: int) -> str:
    """The tag of a VM's `index`-th share device. Fixed: a guest reads its devices' tags once,
    when it boots, so a VM restored from a snapshot taken with share slots (`VMSpec.share_slots`)
    finds its shares under the tags its snapshot's devices had."""
    return f"aenv-vol{index}"


@dataclass(frozen=True)
class NetAttachment:
    """Where the guest NIC plugs in: a tap device that already exists inside network namespace
    `netns` (created by `aenv.network`). The guest's IP is fixed and the same in every sandbox, so
    a restored VM only needs a tap of the same name in its own namespace."""

    netns: str
    tap: str
    mac: str


@dataclass(frozen=True)
class Limits:
    """Per-VMM-process cgroup limits. `None` means the driver's default: memory = guest memory
    plus VMM overhead, pids = a small fixed cap, cpu = `vcpus` cores."""

    memory_max_mib: int | None = None
    pids_max: int | None = None
    cpu_cores: float | None = None


@dataclass(frozen=True)
class VMSpec:
    """Everything needed to cold-boot a VM. `workdir` must exist and be private to this VM;
    `memory_dir` (default: `workdir`) holds the guest memory file and should be on tmpfs."""

    vcpus: int
    memory_mib: int
    kernel: Path
    cmdline: str
    workdir: Path
    initrd: Path | None = None
    disks: tuple[Disk, ...] = ()
    net: NetAttachment | None = None
    memory_dir: Path | None = None
    limits: Limits = field(default_factory=Limits)
    shares: tuple[Share, ...] = ()
    # Share devices the VM has whether or not anything is shared (an unused one exports an
    # empty read-only directory). A restored VM has exactly its snapshot's devices, so a
    # snapshot taken with slots restores VMs with up to that many shares; without, they boot.
    share_slots: int = 0


@dataclass(frozen=True)
class SnapshotTarget:
    """Where `VM.snapshot` writes: device state and sealed disks into `directory`, guest memory
    into `memory_dir` (tmpfs: restores map this file, so it must stay fast and unmodified). Both
    must exist and belong to this one snapshot (they may be the same directory). Sealed disk
    layers may refer to layers of earlier snapshots by path: keep those while this one lives."""

    directory: Path
    memory_dir: Path


@dataclass(frozen=True)
class Snapshot:
    """A complete, immutable saved VM. `memory_file` is None when the guest memory travels inside
    `state_file` (a driver's choice, e.g. when the source's memory was itself a private mapping).
    `compat` names what a restoring VMM must match (driver, VMM version, accelerator, CPU model).
    Without `machine_state` only the disks were saved (`state_file` is empty): such a snapshot
    cannot be restored, only booted from its disks. `layers` are older saved states (oldest
    first) that `state_file` lies over: each holds the pages changed over the one before, the
    first over `memory_file`; they are never written again and are shared by every state
    that names them (a driver's choice, as `memory_file` is)."""

    driver: str
    compat: str
    spec: VMSpec
    state_file: Path
    memory_file: Path | None
    disks: Mapping[str, Path]
    machine_state: bool = True
    layers: tuple[Path, ...] = ()
    # The checksums its manifest recorded, by `files` role: none for a manifest of version 1,
    # or for a snapshot not read from a manifest. `save_manifest` records its files anew.
    recorded: Mapping[str, Checksum] = field(default_factory=dict, compare=False)

    def files(self) -> dict[str, Path]:
        """The files of this saved state by role (`state`, `memory`, `layer-<n>`,
        `disk-<drive>`): what its manifest records checksums of."""
        files = {"state": self.state_file}
        if self.memory_file is not None:
            files["memory"] = self.memory_file
        files |= {f"layer-{i}": path for i, path in enumerate(self.layers, 1)}
        files |= {f"disk-{drive}": path for drive, path in self.disks.items()}
        return files

    def save_manifest(self, directory: Path | None = None) -> Path:
        """Write `snapshot.json` into `directory` (default: next to the state file), so the
        snapshot can be reloaded later, with the checksum of each of its files (read from them
        unless known already, see `checksums`). Atomic: a reader sees the old manifest or the
        new one. Blocking."""
        path = (directory or self.state_file.parent) / SNAPSHOT_MANIFEST
        raw = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, **_snapshot_to_dict(self)}
        found = {role: checksums.of_file(file) for role, file in self.files().items()}
        raw["files"] = {
            role: {"size": c.size, checksums.ALGORITHM: c.digest} for role, c in found.items()
        }
        atomic.write_text(path, json.dumps(raw, indent=2))
        return path

    @classmethod
    def load_manifest(cls, directory: Path) -> Snapshot:
        """The snapshot `directory`'s manifest describes, its files unread. Raises
        `UnknownSavedStateFormat` for another program's or a newer format, else
        `RestoreError` when it cannot be read."""
        try:
            raw = json.loads((directory / SNAPSHOT_MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise RestoreError(f"unreadable snapshot manifest in {directory}: {exc}") from exc
        version = _manifest_version(raw, directory)
        try:
            snapshot = _snapshot_from_dict(raw)
            if version == 1:
                return snapshot
            recorded = {
                str(role): Checksum(int(c["size"]), str(c[checksums.ALGORITHM]))
                for role, c in raw["files"].items()
            }
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RestoreError(f"unreadable snapshot manifest in {directory}: {exc}") from exc
        return replace(snapshot, recorded=recorded)

    def verify(self, directory: Path, unread: Collection[Path] = ()) -> None:
        """Compare each file with the checksum its manifest (in `directory`) recorded; raises
        `CorruptSavedState` naming the first that differs. Nothing to compare for a manifest
        of version 1. Files of `unread` are left out (checked otherwise: chunks of a lazily
        served file are checked against their digests as they come). Blocking."""
        if not self.recorded:
            return
        files = self.files()
        if set(files) != set(self.recorded):
            raise CorruptSavedState(
                f"saved state in {directory} is corrupt: its manifest records the files "
                f"{sorted(self.recorded)} but names {sorted(files)}"
            )
        for role, path in files.items():
            if path in unread:
                continue
            try:
                found = checksums.of_file(path)
            except OSError as exc:
                raise CorruptSavedState(
                    f"saved state in {directory} is corrupt: file {role} ({path}): {exc}"
                ) from exc
            expected = self.recorded[role]
            if found.size != expected.size:
                raise CorruptSavedState(
                    f"saved state in {directory} is corrupt: file {role} ({path}) has "
                    f"{found.size} bytes, its manifest recorded {expected.size}"
                )
            if found.digest != expected.digest:
                raise CorruptSavedState(
                    f"saved state in {directory} is corrupt: file {role} ({path}) checksum mismatch"
                )


class MemorySource(Protocol):
    """A snapshot's memory file read on demand (a `LazyFile` of it): `read` returns the
    `length` bytes at `offset` once it has them, or raises when it cannot have them."""

    @property
    def size(self) -> int: ...

    async def read(self, offset: int, length: int) -> bytes: ...


def _ignore(error: BaseException) -> None:
    return None


@dataclass(frozen=True)
class LazyMemory:
    """Guest memory a restore serves page by page from `source` as the guest touches it, in place
    of `Snapshot.memory_file` (which need not exist here). Reads of `source` run on the event loop
    that called `restore`. `on_failure` is told (on that loop) why the VM's memory could not be
    served; the VM is stopped then (its `wait_exit` returns)."""

    source: MemorySource
    on_failure: Callable[[BaseException], None] = _ignore


@dataclass(frozen=True)
class RestoreSpec:
    """Placement of one restored VM: its own private `workdir` (and tmpfs `memory_dir`), its own
    network attachment (same tap name and MAC as the source, in another namespace), and limits."""

    workdir: Path
    net: NetAttachment | None = None
    memory_dir: Path | None = None
    limits: Limits = field(default_factory=Limits)
    # At most the snapshot's `spec.share_slots` on a restore (`boot_saved` adds devices).
    shares: tuple[Share, ...] = ()
    # The snapshot's memory read on demand, for drivers that can (see the contract above).
    lazy_memory: LazyMemory | None = None


@dataclass(frozen=True)
class VMStats:
    """Resource use of one VMM process. `pss_bytes` counts shared pages (the snapshot memory file
    mapped by many clones) proportionally; `disk_bytes` is what this VM's private writable layers
    occupy on the host."""

    cpu_seconds: float
    rss_bytes: int
    pss_bytes: int
    disk_bytes: int


@dataclass(frozen=True)
class CPUTime:
    """CPU time one VMM process has used since it started. `started` (Unix seconds) tells two
    processes apart: a reading with another `started` is of another VMM (e.g. after a resume)."""

    seconds: float
    started: float


def process_cpu_time(pid: int) -> CPUTime:
    """The CPU time of process `pid`: one read of its /proc stat file, nothing else (no memory
    accounting, unlike `VM.stats`). Raises `DriverError` when the process is gone."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            times = proc.cpu_times()
            started = proc.create_time()
    except psutil.Error as exc:
        raise DriverError(f"VMM process {pid}: {exc}") from exc
    return CPUTime(times.user + times.system, started)


@runtime_checkable
class VM(Protocol):
    """A running or paused VM owned by a driver."""

    @property
    def id(self) -> str: ...

    @property
    def state(self) -> VMState: ...

    @property
    def console_log(self) -> Path:
        """The guest's serial console output (for diagnostics)."""
        ...

    @property
    def share_slots(self) -> int:
        """How many shares the VM's saved states can be restored with (`VMSpec.share_slots`)."""
        ...

    async def pause(self) -> None:
        """Stop the vCPUs; memory and devices stay as they are."""
        ...

    async def resume(self) -> None: ...

    async def snapshot(
        self, target: SnapshotTarget, *, keep_running: bool, machine_state: bool = True
    ) -> Snapshot:
        """Save memory, device state and writable disks at one instant. With `keep_running` the VM
        continues afterwards (in its previous run state) on fresh writable layers; otherwise it is
        stopped, which lets a driver hand its memory file over instead of copying it. Without
        `machine_state` only the disks are saved (the caller has had the guest flush them)."""
        ...

    async def stop(self) -> None:
        """Kill the VMM and release everything it held. Idempotent."""
        ...

    async def wait_exit(self) -> None:
        """Return once the VMM process has exited, for whatever reason (`stop`, a crash, a
        kill -9 from outside). Callers watch for the unplanned cases with it; it releases
        nothing (call `stop`)."""
        ...

    async def stats(self) -> VMStats: ...

    def cpu_time(self) -> CPUTime:
        """The VMM's CPU time so far, cheap enough to read for every VM every few seconds
        (callers batch it off the event loop). Raises `DriverError` when the VM is stopped."""
        ...


@runtime_checkable
class Driver(Protocol):
    """Starts VMs. One instance per host process; safe to use from many tasks at once."""

    @property
    def name(self) -> str: ...

    @property
    def no_shares(self) -> str | None:
        """Why this driver's VMs cannot mount shares (`VMSpec.shares`), or None when they can:
        callers refuse volume mounts with it before any VM starts."""
        ...

    async def boot(self, spec: VMSpec) -> VM:
        """Cold-boot a VM (template builds only: sandboxes are restored snapshots)."""
        ...

    def kernel_image(self, kernel: KernelImages) -> Path:
        """The form of `kernel` this driver's VMM boots (`VMSpec.kernel`)."""
        ...

    async def restore(self, snapshot: Snapshot, target: RestoreSpec) -> VM:
        """Start one VM from `snapshot`, with private copy-on-write memory and disk layers."""
        ...

    async def boot_saved(self, snapshot: Snapshot, target: RestoreSpec) -> VM:
        """Cold-boot `snapshot`'s disks without its memory and device state (a filesystem-only
        snapshot, or a saved state started at another size: `snapshot.spec` says the size).
        Each writable drive gets a private layer over its sealed one, as in `restore`; the NIC
        keeps the snapshot's MAC at `target.net`'s location."""
        ...

    async def export(
        self, snapshot: Snapshot, dest: Path, *, move: bool, memory_dir: Path | None = None
    ) -> Snapshot:
        """Make `dest` (existing, empty) a self-contained copy of `snapshot` and return it (its
        manifest written there): every writable drive as one standalone sealed image in this
        driver's format, whatever chain of layers it was. `move` takes the state and memory
        files over (they must then belong to nobody else); otherwise they are shared, which is
        safe because saved files are never written again. `snapshot` stays usable. The memory
        file goes into `memory_dir` (existing; tmpfs, since restores map it) when given, else
        into `dest`: a directory that is the export's own all the same."""
        ...

    async def load_saved(self, directory: Path, *, unread: Collection[Path] = ()) -> Snapshot:
        """The saved state whose manifest is in `directory` (exported, or pulled back from a
        copy to where it was exported from), checked to be complete and of this driver's
        making: `RestoreError` (`IncompatibleSnapshotError` for another driver's) otherwise.
        The content of the files of `unread` is not read (see `Snapshot.verify`)."""
        ...

    async def restore_many(self, snapshot: Snapshot, targets: Sequence[RestoreSpec]) -> list[VM]:
        """Start one clone per target concurrently. All or nothing: if any clone fails, the others
        are stopped and the first error is raised."""
        ...

    async def detach_memory(
        self,
        snapshot: Snapshot,
        target: SnapshotTarget,
        place: RestoreSpec,
        *,
        flatten: bool = False,
    ) -> Snapshot:
        """`snapshot` with its guest memory as a file in `target.memory_dir` (state into
        `target.directory`) if it travels inside the state file; `snapshot` itself otherwise.
        Restores map a memory file but must parse a stream, so this makes a saved state that will
        be restored (perhaps many times) cheap to restore. With `flatten`, a state saved as
        changes over a memory file is made one file too (restores then share all of its pages,
        and load none). The guest does not run meanwhile; `place` hosts whatever the driver
        needs to load the state."""
        ...

    async def merge_layers(self, snapshot: Snapshot, directory: Path) -> Snapshot:
        """`snapshot` with the older states it lies over (`Snapshot.layers`) and its own state
        merged into one state file in `directory` (existing, ours; the manifest not written),
        so that restores read one state and the older ones are needed no more; `snapshot`
        itself when it has no layers. No VM runs."""
        ...


def _spec_to_dict(spec: VMSpec) -> dict[str, Any]:
    return {
        "vcpus": spec.vcpus,
        "memory_mib": spec.memory_mib,
        "kernel": str(spec.kernel),
        "cmdline": spec.cmdline,
        "workdir": str(spec.workdir),
        "initrd": str(spec.initrd) if spec.initrd else None,
        "disks": [
            {"drive_id": d.drive_id, "path": str(d.path), "read_only": d.read_only}
            for d in spec.disks
        ],
        "net": (
            {"netns": spec.net.netns, "tap": spec.net.tap, "mac": spec.net.mac}
            if spec.net
            else None
        ),
        "memory_dir": str(spec.memory_dir) if spec.memory_dir else None,
        "limits": {
            "memory_max_mib": spec.limits.memory_max_mib,
            "pids_max": spec.limits.pids_max,
            "cpu_cores": spec.limits.cpu_cores,
        },
        "share_slots": spec.share_slots,
    }


def _spec_from_dict(raw: Mapping[str, Any]) -> VMSpec:
    net = raw["net"]
    return VMSpec(
        vcpus=int(raw["vcpus"]),
        memory_mib=int(raw["memory_mib"]),
        kernel=Path(raw["kernel"]),
        cmdline=str(raw["cmdline"]),
        workdir=Path(raw["workdir"]),
        initrd=Path(raw["initrd"]) if raw["initrd"] else None,
        disks=tuple(
            Disk(str(d["drive_id"]), Path(d["path"]), bool(d["read_only"])) for d in raw["disks"]
        ),
        net=NetAttachment(str(net["netns"]), str(net["tap"]), str(net["mac"])) if net else None,
        memory_dir=Path(raw["memory_dir"]) if raw["memory_dir"] else None,
        limits=Limits(**raw["limits"]),
        share_slots=int(raw.get("share_slots", 0)),  # none in manifests written before
    )


def _snapshot_to_dict(snap: Snapshot) -> dict[str, Any]:
    return {
        "driver": snap.driver,
        "compat": snap.compat,
        "spec": _spec_to_dict(snap.spec),
        "state_file": str(snap.state_file),
        "memory_file": str(snap.memory_file) if snap.memory_file else None,
        "disks": {k: str(v) for k, v in snap.disks.items()},
        "machine_state": snap.machine_state,
        "layers": [str(p) for p in snap.layers],
    }


def _manifest_version(raw: Any, directory: Path) -> int:
    """The format version of a parsed manifest: 1 for one written before versions."""
    if not isinstance(raw, dict):
        raise RestoreError(f"unreadable snapshot manifest in {directory}: not a JSON object")
    if "format" not in raw and "version" not in raw:
        return 1
    if raw.get("format") != MANIFEST_FORMAT:
        raise UnknownSavedStateFormat(
            f"the saved state in {directory} is not aenv's: its manifest's format is "
            f"{raw.get('format')!r}, not {MANIFEST_FORMAT!r}"
        )
    version = raw.get("version")
    if not isinstance(version, int) or not 2 <= version <= MANIFEST_VERSION:
        raise UnknownSavedStateFormat(
            f"the saved state in {directory} was written by format version {version}, "
            f"this node reads versions 1 to {MANIFEST_VERSION}"
        )
    return version


def _snapshot_from_dict(raw: Mapping[str, Any]) -> Snapshot:
    return Snapshot(
        driver=str(raw["driver"]),
        compat=str(raw["compat"]),
        spec=_spec_from_dict(raw["spec"]),
        state_file=Path(raw["state_file"]),
        memory_file=Path(raw["memory_file"]) if raw["memory_file"] else None,
        disks={str(k): Path(v) for k, v in raw["disks"].items()},
        machine_state=bool(raw.get("machine_state", True)),
        layers=tuple(Path(p) for p in raw.get("layers", ())),
    )
