"""The sandbox lifecycle on one node: create, kill, timeouts, lookups; pause and resume;
snapshots and forks.

Every change of state goes through the catalog's conditional transition, so a crash leaves
either the old or the new state, and every operation on one sandbox runs under that sandbox's
lock, so concurrent calls converge (pause racing resume racing kill: each runs whole, in some
order, and later ones see the state the earlier ones left). Creates pass an admission gate: a
burst beyond `max_concurrent_creates` waits in a queue instead of failing. The process-local part
of a sandbox (its VM and network slot) lives in `_live`; the catalog row and the sandbox's
directory (its pause checkpoints, see `checkpoints`) are the durable part.

Snapshots and fork checkpoints are stored as templates (E2B does the same: a snapshot id is a
template id, created from and deleted like one). Sandboxes record which saved directory they
were restored from (`SandboxRecord.restored_from`); a fork checkpoint or a deleted snapshot is
removed once no sandbox depends on it any more.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import dataclasses
import logging
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

import httpx
from connectrpc.errors import ConnectError

from aenv.config import Config
from aenv.envd import ENVD_VERSION
from aenv.ids import new_access_token, new_build_id, new_sandbox_id
from aenv.network import EgressPolicy, NftError, Slot, SlotProvider, SlotReclaimer, socks
from aenv.network.settings import SandboxNetwork, SlotEgress
from aenv.orchestrator import checkpoints, consoles, detach, hibernation, metrics_history, warm
from aenv.orchestrator.admission import HostMemory, MemoryBudget, Refusal
from aenv.orchestrator.archive import Archive
from aenv.orchestrator.background import PerSandbox
from aenv.orchestrator.build_steps import StepFailed, warm_up
from aenv.orchestrator.catalog import Catalog, SandboxRecord, VolumeMount
from aenv.orchestrator.envd_client import EnvdClient, EnvdUnavailable
from aenv.orchestrator.kinds import SaveMode, TemplateKind
from aenv.orchestrator.locks import KeyedLocks
from aenv.orchestrator.metrics_history import MetricsHistory
from aenv.orchestrator.reserve import HostReserve
from aenv.orchestrator.residency import ResidencyListener, tell
from aenv.orchestrator.saved import SavedStates
from aenv.orchestrator.states import ASLEEP, KILLABLE, LIVE, SAVED, SandboxState
from aenv.orchestrator.templates import BOOT_READY_TIMEOUT, Template, TemplateStore
from aenv.orchestrator.volumes import VolumeBacking, VolumeStore, guest_mounts
from aenv.orchestrator.warm import Pooled, WarmPools
from aenv.runtime.driver import (
    VM,
    CPUTime,
    Driver,
    DriverError,
    NetAttachment,
    RestoreError,
    RestoreSpec,
    Share,
    Snapshot,
    SnapshotTarget,
)
from aenv.runtime.sweep import Reaper, reap_strays
from aenv.storage.repository import RepositoryError
from aenv.storage.volume_images import ImageBacking
from aenv.timing import Steps

log = logging.getLogger("aenv.orchestrator")

# A restored guest answers in milliseconds under KVM, but under emulation on a saturated host
# (hundreds of creates queued on two cores) it can take tens of seconds: a create should then
# be slow, not fail.
RESTORE_READY_TIMEOUT = 120.0
# Housekeeping rounds (`consoles.INTERVAL` apart) between two reconciliations.
RECONCILE_EVERY = 6
# Seconds between two looks of the refill at pools nobody created from (to shrink them).
REFILL_IDLE = 10.0
# A refill waits until no create has been under way for this long: its restore would compete
# for the CPU with the create and with the new sandbox's first commands.
REFILL_QUIET = 1.0
# What a pooled VM's slot is given until a create takes it: no egress at all.
_NO_EGRESS = SlotEgress(enabled=False, policy=EgressPolicy())
_FAILURES = (DriverError, EnvdUnavailable, OSError, RepositoryError)


class VolumeInUse(RuntimeError):
    """A save that must keep the memory met a volume the guest could not unmount."""


class SandboxNotFound(LookupError):
    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"sandbox {sandbox_id} not found")
        self.sandbox_id = sandbox_id


class CreateFailed(RuntimeError):
    """The sandbox could not be started; nothing of it is left."""


class CapacityReached(RuntimeError):
    """The node already holds `max_sandboxes` sandboxes, the request's owner (an API key)
    already runs `key_max_sandboxes`, or the host has not the memory or disk for more."""


class InvalidState(RuntimeError):
    """The operation does not apply in the sandbox's current state (pause of a paused one)."""

    def __init__(
        self, sandbox_id: str, state: SandboxState, operation: str, hint: str = ""
    ) -> None:
        message = f"cannot {operation} sandbox {sandbox_id}: it is {state.value}"
        super().__init__(f"{message} ({hint})" if hint else message)
        self.state = state


class InvalidNetwork(ValueError):
    """Network settings that cannot work, found before anything is made or changed. `field`
    is the E2B name of the setting at fault (`egressProxy`, `dnsServers`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class OperationFailed(RuntimeError):
    """Pause, resume or snapshot failed; the sandbox is left as it was before."""


@dataclass
class CreateStats:
    """Counters for monitoring (the API exports them)."""

    queued: int = 0  # waiting for admission
    succeeded: int = 0
    failed: int = 0
    refused: collections.Counter[Refusal] = dataclasses.field(default_factory=collections.Counter)


def _cpu_times(vms: Mapping[str, VM]) -> dict[str, CPUTime]:
    """The VMM CPU time of each VM still running (in a thread: one small /proc read each)."""
    found = {}
    for sandbox_id, vm in vms.items():
        with contextlib.suppress(DriverError):
            found[sandbox_id] = vm.cpu_time()
    return found


@dataclass
class _Live:
    vm: VM
    slot: Slot
    # Set before the VMM is stopped on purpose (pause, kill), so its exit is not a crash.
    planned_exit: bool = False


@dataclass(frozen=True)
class GuestEndpoint:
    """Where a running sandbox's guest ports are reached from the host (`host`), which run of
    its VM that is (`incarnation`: it changes on every restore, so connections never outlive a
    VM), and its catalog record."""

    host: str
    incarnation: str
    record: SandboxRecord


@dataclass(frozen=True)
class CreateRequest:
    template: str
    timeout: int
    metadata: Mapping[str, str]
    env_vars: Mapping[str, str]
    auto_pause: bool = False
    auto_resume: bool = False
    network: SandboxNetwork = dataclasses.field(default_factory=SandboxNetwork)
    # What a pause on timeout saves.
    auto_pause_mode: SaveMode = SaveMode.FULL
    # The server's own sandboxes (template build VMs): not listed, and killed at shutdown.
    internal: bool = False
    # (vCPUs, MiB) other than the template's: the template's disks are booted afresh at that
    # size (a saved memory image has one size), without its processes (template builds).
    size: tuple[int, int] | None = None
    # Who asks (an API key's id): at most `key_max_sandboxes` of an owner's run at once.
    owner: str | None = None
    # Volumes mounted into the guest (resolved by `VolumeStore.resolve`).
    volume_mounts: tuple[VolumeMount, ...] = ()


class GuestUnhealthy(RuntimeError):
    """A pause that asked for a healthy guest found envd not answering; nothing was changed."""


class Orchestrator:
    def __init__(
        self,
        config: Config,
        catalog: Catalog,
        driver: Driver,
        slots: SlotProvider,
        templates: TemplateStore,
        archive: Archive | None = None,
        volume_backing: VolumeBacking | None = None,
    ) -> None:
        """`volume_backing`: what holds sized volumes, by default ext4 images mounted on the
        host (`storage.volume_images`, which needs root)."""
        self.config = config
        self.catalog = catalog
        self.driver = driver
        self.slots = slots
        self.templates = templates
        self._live: dict[str, _Live] = {}
        # Slots of VMs being stopped (out of `_live` already, not released yet): still held,
        # so the reconciler must not take them for leaked and release them a second time.
        self._stopping: dict[int, Slot] = {}
        self._locks = KeyedLocks()
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._admission = asyncio.Semaphore(config.max_concurrent_creates)
        # Disk of the creates admitted and not finished: their layers have not grown yet.
        self._disk_pending_mb = 0
        # Creates queued or starting, their guest RAM and owners: their rows (if any yet, in
        # state creating) hold no VM yet.
        self._starting = 0
        self._starting_mb = 0
        self._starting_by: collections.Counter[str | None] = collections.Counter()
        self._last_create = 0.0  # time.monotonic() when the latest create ended
        self.stats = CreateStats()
        self.pools = WarmPools(config.pool_max)
        self._pool_wake = asyncio.Event()
        self._refiller: asyncio.Task[None] | None = None
        self._client = httpx.AsyncClient()
        self._tasks: set[asyncio.Task[None]] = set()
        self.saved = SavedStates(
            catalog,
            templates,
            config.paths.sandboxes,
            archive,
            driver,
            max_uploads=config.max_concurrent_uploads,
        )
        self.detacher = detach.Detacher(
            driver, slots, config.paths.detach, templates.memory_dir / "detach"
        )
        self._settling = PerSandbox("work after the pause")  # _settle_pause
        # Told (sandbox id, VM id) whenever a sandbox's VM stops, whatever the reason: the proxy
        # ends the connections to that VM at once.
        self.vm_stopped: list[Callable[[str, str], None]] = []
        # Told which sandboxes come and go (a cluster node's agent), see `residency`.
        self.residency: list[ResidencyListener] = []
        self.metrics = MetricsHistory()
        # Idle hibernation; the server gives it the proxy's view of the traffic.
        self.hibernation = hibernation.Hibernation(config.hibernate_after)
        paths = config.paths
        self.volumes = VolumeStore(
            catalog,
            paths.volumes,
            volume_backing or ImageBacking(paths.volumes, paths.volume_images),
            self._reserve(),
            config.volume_size_mb,
            driver.no_shares,
        )
        # Run with every reconcile round: the housekeeping of what lives beside the
        # orchestrator (the template builder's uploads).
        self.chores: list[Callable[[], Awaitable[None]]] = []
        # Told the id of each template deleted for users: what others keep of it goes with it
        # (the builder's records, logs and uploads).
        self.template_deleted: list[Callable[[str], Awaitable[None]]] = []

    # -- start-up and shutdown ------------------------------------------------------------

    async def start(self) -> None:
        """Take over what a previous process left. VMs never survive it (the start-up sweep
        kills them), so sandboxes that were running are cleaned up and removed; paused ones stay
        paused, and one caught mid-pause or mid-resume falls back to its newest complete
        checkpoint (a crash never leaves a half-written one in use)."""
        # Also those of the previous server that the start-up sweep cannot tell from others'
        # (re-parented to a subreaper, not to init): they would write to the files reclaimed here.
        await asyncio.to_thread(reap_strays, self.config.home)
        await self.volumes.attach_all()
        for record in self.catalog.list():
            if record.state in SAVED and await self._recover_saved(record):
                continue
            log.warning("reclaiming sandbox %s left in state %s", record.id, record.state)
            await self._reclaim_files(record.id)
            await self.saved.drop_archived(record)
            self.catalog.delete(record.id)
        await asyncio.to_thread(self._sweep_pooled)
        await asyncio.to_thread(self.detacher.sweep)
        for unfinished in await asyncio.to_thread(self.templates.remove_unfinished):
            log.warning("removed saved state %s, cut short by the previous run", unfinished)
        await self.saved.collect()
        self._spawn(self.saved.collect_repository())
        self._spawn(self._housekeeping())
        self._spawn(self._sample_forever())
        if self.hibernation.enabled:
            self._spawn(self._hibernate_forever())
        if self.pools.enabled:
            self._refiller = asyncio.get_running_loop().create_task(self._refill_forever())

    def _sweep_pooled(self) -> None:
        """Remove the directories of VMs a previous process held in its pools (their VMMs are
        gone with it): marked ones that no catalog row names."""
        sandboxes = self.config.paths.sandboxes
        if not sandboxes.is_dir():
            return
        for directory in sandboxes.iterdir():
            if (directory / warm.MARKER).exists() and self.catalog.get(directory.name) is None:
                log.warning("removing pooled VM %s left by the previous run", directory.name)
                for path in self._dirs(directory.name):
                    shutil.rmtree(path, ignore_errors=True)

    async def _recover_saved(self, record: SandboxRecord) -> bool:
        """Whether a sandbox the previous process left saved (or mid-save) stays, paused.

        One caught mid-pause falls back to its newest complete checkpoint, which is at least
        the one its row names. One whose named checkpoint is gone from this disk stays paused
        at it when the repository holds a copy (a resume pulls it back), and also when only
        an older checkpoint is left, here or there: its resume then fails saying so, rather
        than bringing back an older state without a word. With nothing left, it is
        reclaimed."""
        sandbox_dir = self._dirs(record.id)[0]
        found = await asyncio.to_thread(checkpoints.latest_pause, sandbox_dir)
        if found is not None and found[0] >= record.checkpoint_seq:
            seq, snapshot = found
            await asyncio.to_thread(checkpoints.prune_pauses, sandbox_dir, seq)
            paused = self.catalog.transition(
                record.id, [record.state], SandboxState.PAUSED, checkpoint_seq=seq
            )
            # A pause's upload starts once its detach or merge has ended, a hibernated
            # sandbox's never: a crash before then left no copy of this checkpoint.
            if paused is not None and (paused.archived is None or paused.archived.seq != seq):
                self.saved.push_checkpoint(paused, seq, snapshot)
            return True
        if found is None and record.archived is None:
            return False
        copied = record.archived is not None and record.archived.seq == record.checkpoint_seq
        log.warning(
            "sandbox %s: its checkpoint %d is not on this disk; %s",
            record.id,
            record.checkpoint_seq,
            "a resume pulls its repository copy" if copied else "it cannot be resumed",
        )
        self.catalog.transition(record.id, [record.state], SandboxState.PAUSED)
        return True

    async def close(self) -> None:
        """Graceful shutdown: pooled VMs are stopped; running sandboxes are paused (resumable
        after the restart), or killed when `pause_on_shutdown` is off or the pause fails."""
        if self._refiller is not None:
            self._refiller.cancel()
            await asyncio.gather(self._refiller, return_exceptions=True)
        for pooled in self.pools.drain():
            await self._discard(pooled)
        # PAUSING too: a pause or hibernation under way ends before its sandbox is parked.
        running = [
            r.id for r in self.catalog.list([SandboxState.RUNNING, SandboxState.PAUSING, *ASLEEP])
        ]
        await asyncio.gather(*(self._park(sandbox_id) for sandbox_id in running))
        for sandbox_id in list(self._live):
            await self.kill(sandbox_id)
        # Checkpoints are uploaded as they are: detaching their memory is only worth it for a
        # restore soon, and the restarted server can restore either form.
        for sandbox_id in self._settling.ids():
            await self._settling.cancel(sandbox_id)
        await self.saved.close()
        for task in list(self._tasks):
            task.cancel()
        await self._client.aclose()
        await self.volumes.detach_all()

    async def _park(self, sandbox_id: str) -> None:
        async with self._lock(sandbox_id):  # a pause or hibernation under way ends first
            record = self.catalog.get(sandbox_id)
        if record is None or record.state is SandboxState.PAUSED:
            return
        if self.config.pause_on_shutdown and not record.internal:
            with contextlib.suppress(SandboxNotFound, InvalidState, OperationFailed):
                await self.pause(sandbox_id)
                return
        await self.kill(sandbox_id)

    # -- queries --------------------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxRecord:
        record = self.catalog.get(sandbox_id)
        if record is None or record.state.public is None:
            raise SandboxNotFound(sandbox_id)
        return record

    def list(self) -> list[SandboxRecord]:
        """What users see: sandboxes in a public state, the server's own left out."""
        return [r for r in self.catalog.list() if r.state.public is not None and not r.internal]

    def guest_endpoint(self, sandbox_id: str) -> GuestEndpoint:
        """A running sandbox's endpoint (one catalog read: the proxy asks on every request)."""
        live = self._live.get(sandbox_id)
        record = self.catalog.get(sandbox_id)
        if live is None or record is None or record.state not in LIVE:
            raise SandboxNotFound(sandbox_id)
        return GuestEndpoint(str(live.slot.address), live.vm.id, record)

    def is_paused(self, sandbox_id: str) -> bool:
        record = self.catalog.get(sandbox_id)
        return record is not None and record.state.public == "paused"

    def console_logs(self, sandbox_id: str) -> builtins.list[Path]:
        """The guest serial console output of every VM this sandbox has run in (one per
        create, resume or restore), oldest first."""
        self.get(sandbox_id)
        workdir, _ = self._dirs(sandbox_id)
        logs = [p for p in workdir.glob("**/console*.log") if p.is_file()]
        return sorted(logs, key=lambda p: p.stat().st_mtime)

    def envd(self, sandbox_id: str) -> EnvdClient:
        """The client of a running sandbox's envd (template builds drive their VM with it)."""
        endpoint = self.guest_endpoint(sandbox_id)
        return EnvdClient(self._client, endpoint.host, endpoint.record.envd_access_token)

    async def guest_metrics(self, sandbox_id: str) -> dict[str, float]:
        """envd's current resource sample from inside the guest (CPU, memory, disk)."""
        return await self.envd(sandbox_id).metrics()

    def snapshots(self) -> builtins.list[Template]:
        return self.templates.list(kind=TemplateKind.SNAPSHOT)

    # -- create ---------------------------------------------------------------------------

    async def create(self, request: CreateRequest) -> tuple[SandboxRecord, Template]:
        template = self.templates.get(request.template)  # TemplateNotFound propagates
        record = await self._admitted_create(request, template, None)
        return record, template

    async def _admitted_create(
        self, request: CreateRequest, base: Template, parent: SandboxRecord | None
    ) -> SandboxRecord:
        short = await asyncio.to_thread(self._reserve().shortfall)
        if short is not None:
            self.stats.refused[Refusal.DISK if "disk" in short else Refusal.MEMORY] += 1
            raise CapacityReached(f"no new sandboxes: {short}")
        need_mb = request.size[1] if request.size else (parent or base).memory_mb
        await self._admit_memory(need_mb)
        # Rows exist from the moment a create is admitted; the queue holds the rest. Counting
        # and joining the queue happen with no await in between (after the checks above, which
        # await), so concurrent creates see each other and the caps are exact.
        self._check_counts(request.owner)
        return await self._queued_create(request, base, parent, need_mb)

    def _check_counts(self, owner: str | None) -> None:
        """Raises CapacityReached when the node holds `max_sandboxes` or `owner` runs
        `key_max_sandboxes` (queued creates included)."""
        made = self.catalog.count(frozenset(SandboxState) - {SandboxState.CREATING})
        held = made + self._starting
        if held >= self.config.max_sandboxes:
            self.stats.refused[Refusal.SANDBOXES] += 1
            raise CapacityReached(f"this node holds its maximum of {held} sandboxes")
        if owner is not None and self._running_of(owner) >= self.config.key_max_sandboxes:
            self.stats.refused[Refusal.KEY] += 1
            raise CapacityReached(
                "You have reached the maximum number of concurrent sandboxes for this API key "
                f"({self.config.key_max_sandboxes})"
            )

    async def _memory_refusal(
        self, need_mb: int, *, pooling: bool = False
    ) -> tuple[Refusal, str] | None:
        """Why a VM of `need_mb` guest RAM does not fit in memory now (see `admission`).
        A pool refill (`pooling`) also leaves room for one create and counts pooled VMs."""
        config = self.config
        budget = MemoryBudget(
            config.reserve_memory_mb, config.admission_sandbox_mb, config.memory_overcommit
        )
        holding = LIVE | {SandboxState.RESUMING}
        nominal = sum(r.memory_mb for r in self.catalog.list(holding)) + self._starting_mb
        starting = self._starting + sum(self.pools.filling.values())
        if pooling:
            nominal += sum(p.memory_mb for p in self.pools)
            starting += 1
        host = await asyncio.to_thread(HostMemory.now)
        return budget.refusal(host, starting=starting, nominal_mb=nominal, need_mb=need_mb)

    async def _admit_memory(self, need_mb: int) -> None:
        """Raises CapacityReached when the host's memory has no room for one more sandbox,
        after giving back every pooled VM when that could make room."""
        refused = await self._memory_refusal(need_mb)
        if await self._give_back_pooled(refused):
            refused = await self._memory_refusal(need_mb)
        if refused is not None:
            self.stats.refused[refused[0]] += 1
            raise CapacityReached(f"no new sandboxes: {refused[1]}")

    async def _give_back_pooled(self, refused: tuple[Refusal, str] | None) -> bool:
        """Stop every pooled VM when the host is short of available memory; whether any was."""
        if refused is None or refused[0] is not Refusal.MEMORY or not any(self.pools):
            return False
        for pooled in list(self.pools):
            await self._evict(pooled)
        return True

    async def _queued_create(
        self, request: CreateRequest, base: Template, parent: SandboxRecord | None, need_mb: int
    ) -> SandboxRecord:
        owner = request.owner
        self._starting += 1
        self._starting_mb += need_mb
        self._starting_by[owner] += 1
        try:
            return await self._queued_create_counted(request, base, parent)
        finally:
            self._starting -= 1
            self._starting_mb -= need_mb
            self._starting_by[owner] -= 1
            if not self._starting_by[owner]:
                del self._starting_by[owner]
            self._last_create = time.monotonic()

    async def _queued_create_counted(
        self, request: CreateRequest, base: Template, parent: SandboxRecord | None
    ) -> SandboxRecord:
        self.stats.queued += 1
        queued = time.perf_counter()
        try:
            await self._admission.acquire()
        finally:
            self.stats.queued -= 1
        waited_ms = (time.perf_counter() - queued) * 1000
        if waited_ms >= 1:  # only creates that found the admission full
            log.info("create from %s: %.0f ms in the queue", base.template_id, waited_ms)
        disk_mb = (parent or base).disk_size_mb
        try:
            # Checked once admitted, not in the queue: disks are thin, so a queued create
            # holds nothing yet (a burst of 200 on a 60 GiB host was refused when it counted),
            # while the ones starting together see each other's (counted with no await since
            # the check).
            await self._check_disk(disk_mb)
            self._disk_pending_mb += disk_mb
            try:
                record = await self._create(request, base, parent)
            except BaseException:
                self.stats.failed += 1
                raise
            finally:
                self._disk_pending_mb -= disk_mb
        finally:
            self._admission.release()
        self.stats.succeeded += 1
        return record

    async def _check_disk(self, need_mb: int) -> None:
        """Raises CapacityReached when new sandboxes that can write `need_mb` (each one's
        writable layer is bounded at its disk size), on top of the creates starting, do not
        fit in the data filesystem's free space above the reserve. A caller that counts
        `need_mb` right after it races no other create."""
        reserve = self._reserve()
        free_mb = await asyncio.to_thread(reserve.free_disk_mb)
        short = reserve.disk_shortfall(free_mb, self._disk_pending_mb + need_mb)
        if short is not None:
            self.stats.refused[Refusal.DISK] += 1
            raise CapacityReached(f"no new sandboxes: {short}")

    def _reserve(self) -> HostReserve:
        config = self.config
        return HostReserve(config.home, config.reserve_disk_mb, config.reserve_memory_mb)

    async def _check_reserve(self, what: str) -> None:
        """Raises OperationFailed when the host is under a reserve (nothing changed yet)."""
        short = await asyncio.to_thread(self._reserve().shortfall)
        if short is not None:
            raise OperationFailed(f"cannot {what}: {short}")

    def _running_of(self, owner: str) -> int:
        """Sandboxes of `owner` that are not paused, and its creates under way (queued or
        starting: a starting one's row, in state creating, is not counted twice)."""
        running = [
            r
            for r in self.catalog.list()
            if r.owner == owner and r.state.public not in (None, "paused")
        ]
        return len(running) + self._starting_by[owner]

    async def _create(
        self, request: CreateRequest, base: Template, parent: SandboxRecord | None
    ) -> SandboxRecord:
        """A new sandbox restored from `base` (a template, a snapshot or, for fork children of
        `parent`, a fork checkpoint), on a pooled VM when its template's pool has one."""
        pooled = await self._take_pooled(request, base, parent)
        sandbox_id = pooled.sandbox_id if pooled else new_sandbox_id()
        now = time.time()
        shown = parent or base
        async with self._lock(sandbox_id):
            record = self.catalog.insert(
                SandboxRecord(
                    id=sandbox_id,
                    template_id=parent.template_id if parent else base.template_id,
                    alias=parent.alias if parent else (base.aliases[0] if base.aliases else None),
                    state=SandboxState.CREATING,
                    cpu_count=request.size[0] if request.size else shown.cpu_count,
                    memory_mb=request.size[1] if request.size else shown.memory_mb,
                    disk_size_mb=shown.disk_size_mb,
                    started_at=now,
                    end_at=now + request.timeout,
                    metadata=dict(request.metadata),
                    env_vars=dict(request.env_vars),
                    envd_access_token=new_access_token(),
                    auto_pause=request.auto_pause,
                    auto_resume=request.auto_resume,
                    network=request.network,
                    traffic_access_token=_traffic_token(request.network),
                    restored_from=base.snapshot_dir,
                    timeout=request.timeout,
                    auto_pause_mode=request.auto_pause_mode,
                    internal=request.internal,
                    owner=request.owner,
                    volume_mounts=request.volume_mounts,
                )
            )
            try:
                live = await self._adopt(record, pooled, base) if pooled else None
                if live is None:
                    live = await self._launch_base(record, request, base)
            except _FAILURES as e:
                await self._reclaim_files(sandbox_id)
                self.catalog.delete(sandbox_id)
                raise CreateFailed(
                    f"could not start sandbox from template {base.template_id}: {e}"
                ) from e
            except BaseException:
                await self._reclaim_files(sandbox_id)
                self.catalog.delete(sandbox_id)
                raise
            running = self.catalog.transition(
                sandbox_id, [SandboxState.CREATING], SandboxState.RUNNING
            )
            assert running is not None  # only this task changes a row it holds the lock of
            self._started(running, live)
        if not running.internal:
            await tell(self.residency, lambda r: r.sandbox_routed(sandbox_id), f"{sandbox_id} came")
        return running

    async def _launch_base(
        self, record: SandboxRecord, request: CreateRequest, base: Template
    ) -> _Live:
        """Today's create path: restore (or boot) a new VM from `base`."""
        snapshot = await self.saved.base_snapshot(base)
        if request.size is not None:
            vcpus, memory_mib = request.size
            spec = dataclasses.replace(snapshot.spec, vcpus=vcpus, memory_mib=memory_mib)
            snapshot = dataclasses.replace(snapshot, spec=spec)
        return await self._launch(
            record,
            snapshot,
            current_token=base.envd_access_token,
            cold=base.save_mode is SaveMode.FILESYSTEM or request.size is not None,
        )

    async def _launch(
        self, record: SandboxRecord, snapshot: Snapshot, *, current_token: str | None, cold: bool
    ) -> _Live:
        """Start a VM for `record` from `snapshot` (restored, or `cold`-booted from its disks
        alone) on a new network slot, and hand envd the sandbox's token, env and fresh entropy.
        A sandbox with volumes is restored when `snapshot` has enough share slots (templates
        built since they came), else booted: a restored VM has only its snapshot's devices.
        On failure nothing of the VM or slot is left; the sandbox's files are the caller's.
        Raises `VolumeNotFound` when a volume it mounts was deleted (nothing started)."""
        steps = Steps()
        shares = self.volumes.shares(record.volume_mounts)
        vm, slot, envd = await self._start_vm(
            record.id,
            snapshot,
            record.network.egress,
            current_token,
            cold or len(shares) > snapshot.spec.share_slots,
            shares,
            steps,
        )
        try:
            await self._init_envd(record, envd)
        except BaseException:
            await self._stop_vm(vm, slot)
            raise
        steps.mark("/init")
        log.info("started sandbox %s on VM %s: %s", record.id, vm.id, steps)
        live = _Live(vm, slot)
        self._live[record.id] = live
        return live

    async def _start_vm(
        self,
        sandbox_id: str,
        snapshot: Snapshot,
        egress: SlotEgress,
        current_token: str | None,
        cold: bool,
        shares: tuple[Share, ...] = (),
        steps: Steps | None = None,
    ) -> tuple[VM, Slot, EnvdClient]:
        """A VM in the sandbox's directories from `snapshot` (restored, or `cold`-booted from
        its disks alone) on a new slot given `egress`, and the client of its envd. On failure
        nothing of the VM or slot is left; the files are the caller's. The time of each step
        goes into `steps`."""
        steps = steps or Steps()
        workdir, memory_dir = self._dirs(sandbox_id)
        await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(memory_dir.mkdir, parents=True, exist_ok=True)
        slot = await self.slots.acquire(egress=egress.enabled, policy=egress.policy)
        steps.mark("slot")
        vm: VM | None = None
        try:
            net = NetAttachment(slot.netns, slot.guest.tap, slot.guest.mac)
            envd = EnvdClient(self._client, str(slot.address), current_token)
            place = RestoreSpec(workdir=workdir, net=net, memory_dir=memory_dir, shares=shares)
            if cold:
                vm = await self.driver.boot_saved(snapshot, place)
                envd = EnvdClient(self._client, envd.host)  # a fresh envd has no token yet
                await envd.wait_healthy(BOOT_READY_TIMEOUT)
            else:
                vm = await self.driver.restore(snapshot, place)
            steps.mark("cold boot" if cold else "restore")
        except BaseException:
            if vm is not None:
                with contextlib.suppress(DriverError):
                    await vm.stop()
            await self.slots.release(slot)
            raise
        return vm, slot, envd

    async def _stop_vm(self, vm: VM, slot: Slot) -> None:
        """Stop a VM and release its slot, which stays held (`reconcile`) until released."""
        self._stopping[slot.index] = slot
        try:
            with contextlib.suppress(DriverError):
                await vm.stop()
            await self.slots.release(slot)
        finally:
            del self._stopping[slot.index]

    async def _init_envd(self, record: SandboxRecord, envd: EnvdClient) -> None:
        """Hand envd the sandbox's identity: token, env, hostname, fresh entropy."""
        # What a template build set (ENV, USER, WORKDIR), under the sandbox's own env.
        built = self.templates.by_id(record.template_id)
        await envd.init(
            new_token=record.envd_access_token,
            env_vars={**(built.env_vars if built else {}), **_sandbox_env(record)},
            hostname=record.id,
            timeout=RESTORE_READY_TIMEOUT,
            default_user=built.default_user if built else None,
            default_workdir=built.default_workdir if built else None,
            volume_mounts=guest_mounts(record.volume_mounts),
        )

    # -- warm pools -----------------------------------------------------------------------

    def _poolable(
        self, request: CreateRequest, base: Template, parent: SandboxRecord | None
    ) -> bool:
        """Whether a create can run on a pooled VM: one restored from a built template's full
        state, as it is. Snapshots and forks are restored once each, so a pool would only
        hold their memory longer; resized and build VMs are booted, and a VM that mounts
        volumes has them as its VMM's devices from its start."""
        return (
            self.pools.enabled
            and parent is None
            and request.size is None
            and not request.internal
            and not request.volume_mounts
            and base.kind is TemplateKind.TEMPLATE
            and base.save_mode is SaveMode.FULL
        )

    async def _take_pooled(
        self, request: CreateRequest, base: Template, parent: SandboxRecord | None
    ) -> Pooled | None:
        if not self._poolable(request, base, parent):
            return None
        self.pools.note_create(base.template_id)
        self._pool_wake.set()
        pooled, stale = self.pools.take(base.template_id, base.build_id)
        for old in stale:
            await self._discard(old)
        return pooled

    async def _adopt(self, record: SandboxRecord, pooled: Pooled, base: Template) -> _Live | None:
        """Make a pooled VM the sandbox's: its egress rules on the slot, then envd `/init`.
        None when the pooled VM failed (it is gone; the caller restores a new one)."""
        try:
            start = time.perf_counter()
            await self._apply_egress(pooled.slot, _NO_EGRESS, record.network.egress)
            egress = time.perf_counter()
            envd = EnvdClient(self._client, str(pooled.slot.address), base.envd_access_token)
            await self._init_envd(record, envd)
            log.info(
                "pool hit %s: egress %.1f ms, /init %.1f ms",
                record.id,
                (egress - start) * 1000,
                (time.perf_counter() - egress) * 1000,
            )
        except (*_FAILURES, OperationFailed) as e:
            log.warning("pooled VM %s failed at its take, restoring anew: %s", record.id, e)
            await self._discard(pooled)
            return None
        except BaseException:
            await self._discard(pooled)
            raise
        pooled.pin.close()  # the sandbox's row names the saved build now
        await asyncio.to_thread((self._dirs(record.id)[0] / warm.MARKER).unlink)
        live = _Live(pooled.vm, pooled.slot)
        self._live[record.id] = live
        return live

    async def _discard(self, pooled: Pooled) -> None:
        """Stop a pooled VM and remove all of it."""
        await self._stop_vm(pooled.vm, pooled.slot)
        await self._reclaim_files(pooled.sandbox_id)
        pooled.pin.close()

    async def _evict(self, pooled: Pooled) -> None:
        """Give a pooled VM back under memory pressure."""
        self.pools.evict(pooled)
        await self._discard(pooled)

    async def _refill_forever(self) -> None:
        """Keep every pool at its target, one restore at a time and only between creates;
        shrink pools whose template's creates slowed down; give every pooled VM back when the
        host runs short of memory."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(REFILL_IDLE):
                    await self._pool_wake.wait()
            self._pool_wake.clear()
            await self._give_back_pooled(await self._memory_refusal(0))
            for pooled in self.pools.surplus():
                await self._discard(pooled)
            for template_id in self.pools.missing():
                await self._creates_quiet()
                if not await self._fill(template_id):
                    break

    async def _creates_quiet(self) -> None:
        """Wait until no create runs or ended in the last `REFILL_QUIET` seconds. A node busy
        with creates back to back thus refills nothing: its creates miss and restore as
        without pools, no slower, instead of sharing the CPU with restores for the pool."""
        while True:
            quiet_for = time.monotonic() - self._last_create
            if not self._starting and quiet_for >= REFILL_QUIET:
                return
            await asyncio.sleep(max(REFILL_QUIET - quiet_for, 0.05))

    async def _fill(self, template_id: str) -> bool:
        """Restore one VM into the template's pool. False when it cannot now (no memory, the
        template gone or failing); the next wake tries again."""
        template = self.templates.by_id(template_id)
        if template is None or template.kind is not TemplateKind.TEMPLATE:
            return False
        refused = await self._memory_refusal(template.memory_mb, pooling=True)
        if refused is not None:
            log.info("pool of %s not refilled: %s", template_id, refused[1])
            return False
        pooled = await self._restore_pooled(template)
        if pooled is None:
            return False
        self.pools.add(pooled)
        return True

    async def _restore_pooled(self, template: Template) -> Pooled | None:
        sandbox_id = new_sandbox_id()
        workdir = self._dirs(sandbox_id)[0]
        pin = contextlib.ExitStack()
        pin.enter_context(self.saved.pin(Path(template.snapshot_dir)))
        self.pools.filling[template.template_id] += 1
        try:
            await asyncio.to_thread(workdir.mkdir, parents=True)
            await asyncio.to_thread((workdir / warm.MARKER).touch)
            async with self._admission:
                snapshot = await self.saved.base_snapshot(template)
                vm, slot, envd = await self._start_vm(
                    sandbox_id, snapshot, _NO_EGRESS, template.envd_access_token, cold=False
                )
            try:
                await envd.wait_healthy(RESTORE_READY_TIMEOUT)
                await _warm_up(envd, template.default_user or "user")
                await _rehearse_init(envd, template, sandbox_id)
            except BaseException:
                await self._stop_vm(vm, slot)
                raise
        except _FAILURES as e:
            log.warning("pool of %s: restore failed: %s", template.template_id, e)
            await self._reclaim_files(sandbox_id)
            pin.close()
            return None
        except BaseException:
            await self._reclaim_files(sandbox_id)
            pin.close()
            raise
        finally:
            self.pools.filling[template.template_id] -= 1
        return Pooled(
            sandbox_id,
            template.template_id,
            template.build_id,
            template.snapshot_dir,
            vm,
            slot,
            template.memory_mb,
            pin,
        )

    async def _housekeeping(self) -> None:
        """For as long as the node runs: keep every live VM's console file bounded, and every
        `RECONCILE_EVERY` rounds end what no sandbox owns (`reconcile`) and run the `chores`."""
        rounds = 0
        while True:
            await asyncio.sleep(consoles.INTERVAL)
            for live in list(self._live.values()):
                await asyncio.to_thread(consoles.cap, live.vm.console_log)
            rounds += 1
            if rounds % RECONCILE_EVERY == 0:
                await self.reconcile()
                for chore in list(self.chores):
                    try:
                        await chore()
                    except Exception:  # one failed chore must not end the housekeeping
                        log.exception("housekeeping chore %s failed", chore)

    async def _sample_forever(self) -> None:
        while True:
            await asyncio.sleep(self.metrics.interval)
            await self.sample_metrics()

    async def sample_metrics(self) -> None:
        """One round of the metrics history: a sample of every running sandbox (its VMM's CPU
        read on the host, its guest asked only when `MetricsHistory.needs_guest` says so); the
        history of sandboxes that are gone is dropped. A guest that does not answer when asked
        misses this round."""
        records = self.catalog.list()
        running = [r.id for r in records if r.state is SandboxState.RUNNING and not r.internal]
        readings = await asyncio.to_thread(_cpu_times, self._vms_of(running))
        gate = asyncio.Semaphore(metrics_history.CONCURRENCY)

        async def sample(sandbox_id: str, cpu: CPUTime) -> None:
            with contextlib.suppress(SandboxNotFound, EnvdUnavailable):
                await self._sample(sandbox_id, cpu, gate)

        await asyncio.gather(*(sample(i, cpu) for i, cpu in readings.items()))
        self.metrics.keep_only([r.id for r in records])

    async def sample_now(self, sandbox_id: str) -> metrics_history.Sample:
        """A sample of a running sandbox taken now and added to its history. Raises
        `SandboxNotFound` when it has no VM, `EnvdUnavailable` when its guest must be asked and
        does not answer."""
        readings = await asyncio.to_thread(_cpu_times, self._vms_of([sandbox_id]))
        if sandbox_id not in readings:
            raise SandboxNotFound(sandbox_id)
        return await self._sample(sandbox_id, readings[sandbox_id], None)

    async def _sample(
        self, sandbox_id: str, cpu: CPUTime, gate: asyncio.Semaphore | None
    ) -> metrics_history.Sample:
        guest = None
        if self.metrics.needs_guest(sandbox_id, cpu):
            async with gate or contextlib.nullcontext():
                guest = await self.guest_metrics(sandbox_id)
        return self.metrics.record(sandbox_id, cpu, guest)

    def _vms_of(self, sandbox_ids: builtins.list[str]) -> dict[str, VM]:
        return {i: live.vm for i in sandbox_ids if (live := self._live.get(i)) is not None}

    async def reconcile(self) -> None:
        """End what the catalog does not own: a live VM whose sandbox is not running any more
        (stopped, its slot released), VMMs and cgroups no VM object stands for (a failed or
        cancelled operation that dropped one without stopping it), VMMs of this node that this
        process did not start (a killed server's), and network slots nothing holds any more."""
        for sandbox_id in list(self._live):
            async with self._lock(sandbox_id):
                record = self.catalog.get(sandbox_id)
                if record is not None and record.state in LIVE:
                    continue
                live = self._live.pop(sandbox_id, None)
                if live is not None:
                    log.warning("sandbox %s: its VM outlived it; stopping it", sandbox_id)
                    await self._stop(sandbox_id, live)
                if record is None:  # nothing names its files any more either
                    await self._reclaim_files(sandbox_id)
        if isinstance(self.driver, Reaper):
            await asyncio.to_thread(self.driver.reap_unowned)
        await asyncio.to_thread(reap_strays, self.config.home)
        if isinstance(self.slots, SlotReclaimer):
            held = [live.slot for live in self._live.values()] + list(self._stopping.values())
            held += [pooled.slot for pooled in self.pools]
            await self.slots.reclaim_leaked(held)

    def _started(self, record: SandboxRecord, live: _Live) -> None:
        self._schedule_expiry(record)
        self.hibernation.awake(record.id)
        self._spawn(self._watch_vmm(record.id, live))

    async def _watch_vmm(self, sandbox_id: str, live: _Live) -> None:
        """A VMM that exits on its own (crash, OOM kill, kill -9) takes its sandbox with it: the
        sandbox is reported gone and its slot and files are released, other sandboxes untouched."""
        await live.vm.wait_exit()
        if live.planned_exit or self._live.get(sandbox_id) is not live:
            return
        log.warning("sandbox %s: its VMM exited unexpectedly; removing it", sandbox_id)
        await self.kill(sandbox_id)

    # -- kill -----------------------------------------------------------------------------

    async def kill(self, sandbox_id: str) -> bool:
        """Stop and forget a sandbox. False when it does not exist (or is already going)."""
        async with self._lock(sandbox_id):
            record = self.catalog.transition(sandbox_id, KILLABLE, SandboxState.KILLING)
            if record is None:
                return False
            await self._forget_locked(sandbox_id, drop_archived=record)
        if not record.internal:
            await tell(self.residency, lambda r: r.sandbox_gone(sandbox_id), f"{sandbox_id} left")
        await self.saved.collect()
        return True

    async def _stop(self, sandbox_id: str, live: _Live) -> None:
        live.planned_exit = True
        for listener in self.vm_stopped:
            listener(sandbox_id, live.vm.id)
        await self._stop_vm(live.vm, live.slot)

    def _live_of(self, sandbox_id: str) -> _Live:
        """The VM of a sandbox whose row says it runs (the caller holds its lock). Raises
        `SandboxNotFound` when it has none (its VM vanished between reconcile passes): the
        sandbox is gone for its users, as when its VMM exits, and is removed once the lock is
        free, with whatever of its VM and slot is left."""
        live = self._live.get(sandbox_id)
        if live is None:
            log.warning("sandbox %s: running without a VM; removing it", sandbox_id)
            self._spawn(self._remove_vanished(sandbox_id))
            raise SandboxNotFound(sandbox_id)
        return live

    async def _remove_vanished(self, sandbox_id: str) -> None:
        await self.kill(sandbox_id)
        await self.reconcile()

    def _lock(self, sandbox_id: str) -> contextlib.AbstractAsyncContextManager[None]:
        return self._locks.hold(sandbox_id)

    def _dirs(self, sandbox_id: str) -> tuple[Path, Path]:
        """A sandbox's directory (VM work dir, checkpoints) and its memory directory (tmpfs)."""
        return (
            self.config.paths.sandboxes / sandbox_id,
            self.templates.memory_dir / "sandboxes" / sandbox_id,
        )

    async def _reclaim_files(self, sandbox_id: str) -> None:
        for path in self._dirs(sandbox_id):
            await asyncio.to_thread(shutil.rmtree, path, True)

    # -- pause and resume -----------------------------------------------------------------

    async def pause(
        self, sandbox_id: str, *, mode: SaveMode = SaveMode.FULL, require_healthy: bool = False
    ) -> SandboxRecord:
        """Save the sandbox and stop it; it stays, paused, until resumed or killed.

        1. Check the guest answers (with `require_healthy`; else it is left running).
        2. RUNNING -> PAUSING; for a FILESYSTEM save, have the guest flush its page cache.
        3. The driver saves checkpoint `pause-<seq>` (what `mode` says) and stops the VM.
           On failure the checkpoint is removed and the sandbox runs on (PAUSING -> RUNNING).
        4. Free the slot; PAUSING -> PAUSED with the new `checkpoint_seq` and `checkpoint_mode`.
        5. Prune older checkpoints; detach and upload this one in the background.
        A sandbox with volumes has its guest unmount them first (`_volumes_released`); when one
        is in use, only its filesystem is saved. A hibernated sandbox is saved already: its
        checkpoint becomes the pause's."""
        async with self._lock(sandbox_id):
            record = self.get(sandbox_id)
            if record.state is SandboxState.HIBERNATED:
                return await self._pause_hibernated(record)
            if record.state is not SandboxState.RUNNING:
                raise InvalidState(sandbox_id, record.state, "pause")
            await self._check_reserve(f"pause sandbox {sandbox_id}")
            if require_healthy:
                try:
                    await self._envd(record).wait_healthy(5.0)
                except EnvdUnavailable as e:
                    raise GuestUnhealthy(f"sandbox {sandbox_id}: envd is not answering") from e
            return await self._pause_locked(record, mode, SandboxState.PAUSED)

    async def _pause_locked(
        self, record: SandboxRecord, mode: SaveMode, to: SandboxState
    ) -> SandboxRecord:
        """Steps 2-5 of `pause` (the caller holds the lock, the sandbox runs), ending in `to`:
        PAUSED, or HIBERNATED, whose timeout keeps running and whose checkpoint stays local
        (it is detached and uploaded only if the sandbox is then paused for good). A
        hibernation must keep the memory: a volume in use fails it (`OperationFailed`)."""
        sandbox_id = record.id
        live = self._live_of(sandbox_id)
        sandbox_dir = self._dirs(sandbox_id)[0]
        seq = record.checkpoint_seq + 1
        target = checkpoints.pause_dir(sandbox_dir, seq)
        self.catalog.transition(sandbox_id, [SandboxState.RUNNING], SandboxState.PAUSING)
        if to is SandboxState.PAUSED:
            self._cancel_timer(sandbox_id)
        live.planned_exit = True
        try:
            hibernating = to is SandboxState.HIBERNATED
            released = self._volumes_released(
                record, live, mode, keep_running=False, memory_required=hibernating
            )
            async with released as mode:
                if mode is SaveMode.FILESYSTEM:
                    await self._envd(record).sync()
                await asyncio.to_thread(target.mkdir)
                saved = await live.vm.snapshot(
                    SnapshotTarget(target, target), keep_running=False, machine_state=mode.memory
                )
        except (*_FAILURES, VolumeInUse) as e:
            await asyncio.to_thread(shutil.rmtree, target, True)
            live.planned_exit = False
            restored = self.catalog.transition(
                sandbox_id, [SandboxState.PAUSING], SandboxState.RUNNING
            )
            if restored is not None:
                self._schedule_expiry(restored)
            raise OperationFailed(f"pause of sandbox {sandbox_id} failed: {e}") from e
        self._live.pop(sandbox_id, None)
        await self._stop(sandbox_id, live)
        paused = self.catalog.transition(
            sandbox_id,
            [SandboxState.PAUSING],
            to,
            checkpoint_seq=seq,
            checkpoint_mode=mode,
        )
        assert paused is not None
        await self._settling.cancel(sandbox_id)  # an earlier pause's: uploads stay in order
        await asyncio.to_thread(checkpoints.prune_pauses, sandbox_dir, seq)
        if to is SandboxState.PAUSED:
            self._settling.start(sandbox_id, self._settle_pause(paused, seq, saved))
        return paused

    async def _pause_hibernated(self, record: SandboxRecord) -> SandboxRecord:
        """A pause of a hibernated sandbox (the caller holds the lock): its checkpoint is the
        pause's, detached and uploaded as a pause's; its timeout stops."""
        paused = self.catalog.transition(record.id, [SandboxState.HIBERNATED], SandboxState.PAUSED)
        assert paused is not None
        self._cancel_timer(record.id)
        saved = await self.saved.paused_checkpoint(paused)
        self._settling.start(record.id, self._settle_pause(paused, paused.checkpoint_seq, saved))
        return paused

    # -- idle hibernation -----------------------------------------------------------------

    async def _hibernate_forever(self) -> None:
        while True:
            await asyncio.sleep(self.hibernation.interval)
            await self.hibernate_idle()

    async def hibernate_idle(self) -> None:
        """One look for idle sandboxes (`hibernation.Hibernation.due`): each is hibernated
        unless its guest still runs a command, or holds a volume in use (its save would keep
        only the filesystem, see `_volumes_released`), either of which starts its idle clock
        again."""
        running = [r.id for r in self.catalog.list([SandboxState.RUNNING]) if not r.internal]
        self.hibernation.keep_only(running)
        for sandbox_id in self.hibernation.due(running):
            try:
                await self._hibernate(sandbox_id)
            except (SandboxNotFound, EnvdUnavailable, OperationFailed) as e:
                log.info("sandbox %s not hibernated: %s", sandbox_id, e)
                self.hibernation.awake(sandbox_id)

    async def _hibernate(self, sandbox_id: str) -> None:
        async with self._lock(sandbox_id):
            record = self.catalog.get(sandbox_id)
            if record is None or record.state is not SandboxState.RUNNING:
                return
            if sandbox_id not in self.hibernation.due([sandbox_id]):
                return  # traffic came while it waited for the lock
            if await hibernation.guest_runs_commands(self._envd(record)):
                self.hibernation.awake(sandbox_id)
                return
            if sandbox_id not in self.hibernation.due([sandbox_id]):
                return  # traffic came while envd was asked
            await self._pause_locked(record, SaveMode.FULL, SandboxState.HIBERNATED)
            log.info("sandbox %s hibernated", sandbox_id)

    async def wake(self, sandbox_id: str) -> None:
        """Restore a hibernated sandbox from its checkpoint, its timeout as it was. Raises
        `OperationFailed` when that fails (it stays hibernated)."""
        async with self._lock(sandbox_id):
            record = self.catalog.get(sandbox_id)
            if record is None or record.state is not SandboxState.HIBERNATED:
                return
            waking = self.catalog.transition(
                sandbox_id, [SandboxState.HIBERNATED], SandboxState.WAKING
            )
            assert waking is not None
            cold = waking.checkpoint_mode is SaveMode.FILESYSTEM
            try:
                live = await self._launch_checkpoint(waking, cold)
            except _FAILURES as e:
                self.catalog.transition(sandbox_id, [SandboxState.WAKING], SandboxState.HIBERNATED)
                raise OperationFailed(f"wake of sandbox {sandbox_id} failed: {e}") from e
            running = self.catalog.transition(
                sandbox_id, [SandboxState.WAKING], SandboxState.RUNNING
            )
            assert running is not None
            self._started(running, live)

    async def _settle_pause(self, record: SandboxRecord, seq: int, saved: Snapshot) -> None:
        """After a pause returns: detach the checkpoint's memory, so the resume maps it rather
        than parses it (unless the sandbox was resumed first), then upload the checkpoint."""
        directory = checkpoints.pause_dir(self._dirs(record.id)[0], seq)
        try:
            detached = await self.detacher.detach(saved, directory)
            if detached is None:
                detached = await self.detacher.merge(saved, directory)
            if detached is not None:
                async with self._lock(record.id):
                    current = self.catalog.get(record.id)
                    if (
                        current is not None
                        and current.state is SandboxState.PAUSED
                        and current.checkpoint_seq == seq
                    ):
                        await asyncio.to_thread(detach.adopt, directory, detached)
                        saved = detached
                    else:
                        await asyncio.to_thread(detach.discard, directory)
        finally:
            # Also when cancelled: whoever cancels (kill, shutdown) decides about the upload.
            self.saved.push_checkpoint(record, seq, saved)

    async def resume(
        self, sandbox_id: str, timeout: int, *, mode: SaveMode = SaveMode.FULL
    ) -> tuple[SandboxRecord, bool]:
        """Start a paused sandbox again from its newest checkpoint (cold-booted from its disks
        when `mode` is FILESYSTEM or it was paused filesystem-only). Returns the record and
        whether it was resumed (False: it was running already; nothing changed)."""
        async with self._lock(sandbox_id):
            record = self.get(sandbox_id)
            if record.state.public == "running":
                return record, False
            if record.state is not SandboxState.PAUSED:
                raise InvalidState(sandbox_id, record.state, "resume")
            resuming = self.catalog.transition(
                sandbox_id, [SandboxState.PAUSED], SandboxState.RESUMING
            )
            assert resuming is not None
            steps = Steps()
            # A detach still under way would be discarded once the sandbox runs, and meanwhile
            # its VMM competes with this restore for the CPU: stop it (the upload still starts).
            await self._settling.cancel(sandbox_id)
            steps.mark("settling")
            cold = SaveMode.FILESYSTEM in (mode, record.checkpoint_mode)
            try:
                live = await self._launch_checkpoint(resuming, cold)
            except _FAILURES as e:
                self.catalog.transition(sandbox_id, [SandboxState.RESUMING], SandboxState.PAUSED)
                raise OperationFailed(f"resume of sandbox {sandbox_id} failed: {e}") from e
            steps.mark("launch")
            log.info("resume of sandbox %s: %s", sandbox_id, steps)
            running = self.catalog.transition(
                sandbox_id,
                [SandboxState.RESUMING],
                SandboxState.RUNNING,
                end_at=time.time() + timeout,
            )
            assert running is not None
            self._started(running, live)
            return running, True

    async def connect(
        self, sandbox_id: str, timeout: int, *, mode: SaveMode = SaveMode.FULL
    ) -> tuple[SandboxRecord, bool]:
        """E2B `connect`: a running sandbox's timeout only grows; a paused one is resumed."""
        record, resumed = await self.resume(sandbox_id, timeout, mode=mode)
        if not resumed:
            record = self.extend_timeout(sandbox_id, timeout)
        return record, resumed

    # -- moving between nodes (a cluster sharing one snapshot repository) -----------------

    async def release(self, sandbox_id: str) -> SandboxRecord:
        """Give a sandbox up to another node: paused first when it runs, the upload of its
        checkpoint to the repository waited for, then forgotten here (its files go, the copy
        stays: it is the adopter's now). Returns the record for `adopt`. Raises
        `InvalidState` when it is neither running nor paused or mounts volumes,
        `OperationFailed` when no copy reached the repository (it stays here, paused)."""
        if self.saved.archive is None:
            raise OperationFailed(
                f"sandbox {sandbox_id} cannot move: this node has no snapshot repository"
            )
        record = self.get(sandbox_id)
        if record.volume_mounts:
            # Volumes are directories of this node: elsewhere its mounts would find nothing.
            raise InvalidState(sandbox_id, record.state, "move", "it mounts volumes of this node")
        if record.state in (SandboxState.RUNNING, *ASLEEP):
            await self.pause(sandbox_id)
        settling = self._settling.get(sandbox_id)
        if settling is not None:
            await asyncio.gather(settling, return_exceptions=True)
        await self.saved.wait_push(sandbox_id)
        async with self._lock(sandbox_id):
            record = self.get(sandbox_id)
            if record.state is not SandboxState.PAUSED:
                raise InvalidState(sandbox_id, record.state, "move")
            if record.archived is None or record.archived.seq != record.checkpoint_seq:
                raise OperationFailed(
                    f"sandbox {sandbox_id} cannot move: its checkpoint did not reach the "
                    "repository (see the node's log)"
                )
            await self._forget_locked(sandbox_id)
        await tell(self.residency, lambda r: r.sandbox_gone(sandbox_id), f"{sandbox_id} left")
        await self.saved.collect()
        return record

    async def adopt(self, record: SandboxRecord) -> SandboxRecord:
        """Take a paused sandbox another node released (or lost with its node): it is paused
        here, and its resume pulls the repository's copy of its checkpoint. An id this node
        holds already is left as it is. Raises `InvalidState` for a record that is not paused
        with a copy in the repository."""
        if record.state is not SandboxState.PAUSED or record.archived is None:
            raise InvalidState(record.id, record.state, "adopt", "no copy in the repository")
        if self.saved.archive is None:
            raise OperationFailed(f"cannot adopt {record.id}: this node has no repository")
        async with self._lock(record.id):
            existing = self.catalog.get(record.id)
            if existing is not None:
                return existing
            # Its own files are in the repository's copy: nothing here is its base.
            adopted = self.catalog.insert(dataclasses.replace(record, restored_from=""))
        await tell(self.residency, lambda r: r.sandbox_routed(record.id), f"{record.id} came")
        return adopted

    async def adopt_template(self, template: Template) -> Template:
        """Take a snapshot or built template another node made, whose copy is in the shared
        repository: it is recorded here under this node's directories, and the first sandbox
        started from it pulls its files. The same build held already is left as it is. Raises
        `OperationFailed` without a repository or a copy to pull."""
        if self.saved.archive is None:
            raise OperationFailed(f"cannot adopt {template.template_id}: no repository here")
        movable = (TemplateKind.SNAPSHOT, TemplateKind.TEMPLATE)
        if template.manifest_id is None or template.kind not in movable:
            raise OperationFailed(
                f"cannot adopt {template.template_id}: only snapshots and built templates "
                "stored in the repository move between nodes"
            )
        existing = self.templates.by_id(template.template_id)
        if existing is not None and existing.build_id == template.build_id:
            return existing
        build_dir = self.templates.directory / template.template_id / template.build_id
        adopted = dataclasses.replace(template, snapshot_dir=str(build_dir), deleted=False)
        await asyncio.to_thread(build_dir.parent.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(self.templates.save, adopted)
        return adopted

    async def forget(self, sandbox_id: str) -> bool:
        """Drop a sandbox that lives on another node now (this node was cut off while it
        moved): its VM stops and its files go here, its repository copy stays (the other
        node's). False when it is not here."""
        async with self._lock(sandbox_id):
            if self.catalog.get(sandbox_id) is None:
                return False
            await self._forget_locked(sandbox_id)
        await self.saved.collect()
        return True

    async def _forget_locked(
        self, sandbox_id: str, *, drop_archived: SandboxRecord | None = None
    ) -> None:
        """Stop a sandbox's VM and remove its files and row; with `drop_archived` (its record as
        the caller last saw it) also its copy in the repository."""
        self._cancel_timer(sandbox_id)
        await self._settling.cancel(sandbox_id)
        await self.saved.cancel_push(sandbox_id)
        live = self._live.pop(sandbox_id, None)
        if live is not None:
            await self._stop(sandbox_id, live)
        await self._reclaim_files(sandbox_id)
        if drop_archived is not None:
            await self.saved.drop_archived(self.catalog.get(sandbox_id) or drop_archived)
        self.catalog.delete(sandbox_id)

    async def endpoint_for_traffic(self, sandbox_id: str) -> GuestEndpoint:
        """The proxy's lookup: a paused sandbox that asked for `autoResume` is resumed first,
        a hibernated one woken."""
        self.hibernation.awake(sandbox_id)  # before any await: a hibernation checks it last
        record = self.catalog.get(sandbox_id)
        if record is not None and record.state is SandboxState.PAUSING:
            async with self._lock(sandbox_id):  # a pause or hibernation under way: its end
                record = self.catalog.get(sandbox_id)
        if record is not None and record.auto_resume and record.state.public == "paused":
            with contextlib.suppress(InvalidState):
                await self.resume(sandbox_id, record.timeout)
        elif record is not None and record.state in ASLEEP:
            await self.wake(sandbox_id)
        return self.guest_endpoint(sandbox_id)

    def _envd(self, record: SandboxRecord) -> EnvdClient:
        """A live sandbox's envd (the caller holds its lock, so the VM is there)."""
        live = self._live_of(record.id)
        return EnvdClient(self._client, str(live.slot.address), record.envd_access_token)

    # -- snapshots and forks ----------------------------------------------------------------

    async def snapshot(
        self, sandbox_id: str, *, name: str | None = None, mode: SaveMode = SaveMode.FULL
    ) -> Template:
        """A persistent, named snapshot of the sandbox, which keeps running (or stays paused).
        A name already used by a snapshot gets this new state under the same id."""
        existing = self._snapshot_named(name)
        template_id = existing.template_id if existing else new_sandbox_id()
        aliases = (name,) if name else ()
        template = await self._checkpoint(
            sandbox_id, template_id, TemplateKind.SNAPSHOT, aliases, mode
        )
        if existing is not None:
            await self.saved.collect()  # the previous state, unless sandboxes still use it
            await self.saved.drop(existing.manifest_id)
        return template

    async def save_template(
        self, sandbox_id: str, template_id: str, kind: TemplateKind, aliases: tuple[str, ...]
    ) -> Template:
        """Save a running sandbox's state, memory included, as a new build of `template_id`
        (template builds: the finished template and its cached intermediate steps)."""
        # Finished templates are restored by every sandbox; cached steps only by a rebuild.
        template = await self._checkpoint(
            sandbox_id,
            template_id,
            kind,
            aliases,
            SaveMode.FULL,
            detach_memory=kind is TemplateKind.TEMPLATE,
        )
        await self.saved.collect()  # the build it replaced, unless sandboxes still use it
        return template

    def _snapshot_named(self, name: str | None) -> Template | None:
        if name is None:
            return None
        for template in self.templates.list(kind=TemplateKind.SNAPSHOT):
            if name in template.aliases:
                return template
        return None

    async def fork(
        self, source: str, count: int, timeout: int, *, owner: str | None = None
    ) -> builtins.list[SandboxRecord | BaseException]:
        """`count` new sandboxes from the state of `source`: a sandbox (running or paused), or
        a snapshot id or name. One entry per child, a record or its error.

        1. Checkpoint a sandbox source once, as a FORK template (a snapshot is used as it is).
        2. Pin it, and start the children concurrently through admission, each with its own id,
           token, slot and entropy. A child that fails leaves nothing; the others run.
        3. Collect: the checkpoint goes now if no child started from it, else with the last."""
        parent: SandboxRecord | None
        try:
            parent = self.get(source)
        except SandboxNotFound:
            parent = None
        start = time.perf_counter()
        if parent is None:
            try:
                base = self.templates.get(source)
            except LookupError as e:
                raise SandboxNotFound(source) from e
            await self._check_disk(count * base.disk_size_mb)
        else:
            # Refused before the checkpoint: a fork that cannot fit changes nothing.
            await self._check_disk(count * parent.disk_size_mb)
            # With more than one child, detaching the memory once beats each child parsing
            # it; a checkpoint of changed pages over a memory file is not detached: each child
            # loads only those pages (in memory layers: merged once, not composed per child).
            base = await self._checkpoint(
                source,
                new_sandbox_id(),
                TemplateKind.FORK,
                (),
                SaveMode.FULL,
                detach_memory=count > 1,
            )
        saved = time.perf_counter()
        with self.saved.pin(Path(base.snapshot_dir)):
            children = await self._start_children(base, parent, count, timeout, owner)
        log.info(
            "fork of %s: checkpoint %.0f ms, %d children %.0f ms",
            source,
            (saved - start) * 1000,
            count,
            (time.perf_counter() - saved) * 1000,
        )
        await self.saved.collect()  # a fork checkpoint no child started from
        return children

    async def _start_children(
        self,
        base: Template,
        parent: SandboxRecord | None,
        count: int,
        timeout: int,
        owner: str | None,
    ) -> builtins.list[SandboxRecord | BaseException]:
        request = CreateRequest(
            template=base.template_id,
            timeout=timeout,
            metadata=parent.metadata if parent else {},
            env_vars=parent.env_vars if parent else {},
            auto_pause=parent.auto_pause if parent else False,
            auto_resume=parent.auto_resume if parent else False,
            network=parent.network if parent else SandboxNetwork(),
            owner=owner,
            # Children of a sandbox mount its volumes; a snapshot carries none.
            volume_mounts=parent.volume_mounts if parent else (),
        )
        children = await asyncio.gather(
            *(self._admitted_create(request, base, parent) for _ in range(count)),
            return_exceptions=True,
        )
        return list(children)

    async def _checkpoint(
        self,
        sandbox_id: str,
        template_id: str,
        kind: TemplateKind,
        aliases: tuple[str, ...],
        mode: SaveMode,
        *,
        detach_memory: bool = False,
    ) -> Template:
        """Save the sandbox's current state as template `template_id` (a new build of it), its
        memory detached into a file first when `detach_memory` (see detach.py)."""
        await self.wake(sandbox_id)  # a hibernated sandbox is saved as it runs
        build_id = new_build_id()
        dest = self.templates.directory / template_id / build_id
        with self.saved.pin(dest):
            return await self._checkpoint_into(
                dest, sandbox_id, template_id, kind, aliases, mode, detach_memory
            )

    async def _checkpoint_into(
        self,
        dest: Path,
        sandbox_id: str,
        template_id: str,
        kind: TemplateKind,
        aliases: tuple[str, ...],
        mode: SaveMode,
        detach_memory: bool,
    ) -> Template:
        # Its memory file on tmpfs, as a template's: restores map it.
        memory_dir = self.templates.build_memory_dir(template_id, dest.name)
        steps = Steps()
        async with self._lock(sandbox_id):
            steps.mark("lock")
            record = self.get(sandbox_id)
            await self._check_reserve(f"save sandbox {sandbox_id}")
            await asyncio.to_thread(dest.mkdir, parents=True)
            await asyncio.to_thread(memory_dir.mkdir, parents=True)
            try:
                if record.state is SandboxState.RUNNING:
                    live = self._live_of(record.id)
                    released = self._volumes_released(record, live, mode, keep_running=True)
                    async with released as mode:
                        if mode is SaveMode.FILESYSTEM:
                            await self._envd(record).sync()
                        saved = await self._save_running(record, dest, memory_dir, mode, steps)
                elif record.state is SandboxState.PAUSED:
                    if mode is SaveMode.FILESYSTEM and record.checkpoint_mode is SaveMode.FULL:
                        # Its disks lack what the guest had not written back when it paused.
                        raise InvalidState(
                            sandbox_id,
                            record.state,
                            "take a filesystem-only snapshot of",
                            "resume it first",
                        )
                    try:
                        paused = await self.saved.paused_checkpoint(record)
                        saved = await self.driver.export(
                            paused, dest, move=False, memory_dir=memory_dir
                        )
                    except _FAILURES as e:
                        raise OperationFailed(f"snapshot of {sandbox_id} failed: {e}") from e
                    if record.checkpoint_mode is SaveMode.FILESYSTEM:
                        mode = SaveMode.FILESYSTEM
                else:
                    raise InvalidState(sandbox_id, record.state, "snapshot")
                if detach_memory and mode is SaveMode.FULL:
                    # Templates are restored by every sandbox: one memory file that all of
                    # them share beats each loading the pages the build changed.
                    saved = await self.detacher.detach_in_place(
                        saved, dest, flatten=kind is TemplateKind.TEMPLATE
                    )
                    steps.mark("detach")
            except BaseException:
                for partial in (dest, memory_dir):
                    await asyncio.to_thread(shutil.rmtree, partial, True)
                raise
        template = Template(
            template_id=template_id,
            build_id=dest.name,
            aliases=aliases,
            cpu_count=record.cpu_count,
            memory_mb=record.memory_mb,
            disk_size_mb=record.disk_size_mb,
            envd_version=ENVD_VERSION,
            envd_access_token=record.envd_access_token or "",
            created_at=time.time(),
            snapshot_dir=str(dest),
            kind=kind,
            source_sandbox_id=sandbox_id,
            save_mode=mode,
        )
        await asyncio.to_thread(self.templates.save, template)
        steps.mark("template")
        log.info("checkpoint of %s as %s: %s", sandbox_id, kind, steps)
        if kind is TemplateKind.SNAPSHOT:
            self._spawn(self.saved.push_template(template))
        return template

    @contextlib.asynccontextmanager
    async def _volumes_released(
        self,
        record: SandboxRecord,
        live: _Live,
        mode: SaveMode,
        *,
        keep_running: bool,
        memory_required: bool = False,
    ) -> AsyncIterator[SaveMode]:
        """Around a save of running `record` with `mode`: yields the mode the save can have.
        QEMU saves no mounted 9p device, so a guest with volumes unmounts them first (envd
        covers their paths meanwhile, see `aenv.envd.mounts`), and mounts them again after a
        save it runs on (`keep_running`) or one that failed. When one is in use, or the VM has
        fewer share slots than volumes (booted before they came; a restore of its state could
        not attach them), the save keeps only the filesystem: the volumes are on the host, and
        mounted again at the next boot. With `memory_required`, that raises `VolumeInUse`."""
        if not (record.volume_mounts and mode.memory):
            yield mode
            return
        mounts = guest_mounts(record.volume_mounts)
        envd = self._envd(record)
        if live.vm.share_slots < len(mounts) or not await envd.release_volumes(mounts):
            if memory_required:
                raise VolumeInUse(f"sandbox {record.id}: a volume is in use")
            log.info("sandbox %s: volumes stay mounted, its filesystem alone is saved", record.id)
            yield SaveMode.FILESYSTEM
            return
        try:
            yield mode
        except BaseException:
            try:
                await envd.mount_volumes(mounts)
            except EnvdUnavailable:  # the save's failure is what its caller reports
                log.exception("sandbox %s: volumes not mounted again", record.id)
            raise
        if keep_running:
            await envd.mount_volumes(mounts)

    async def _save_running(
        self, record: SandboxRecord, dest: Path, memory_dir: Path, mode: SaveMode, steps: Steps
    ) -> Snapshot:
        """Checkpoint a running sandbox without stopping it: its disks are sealed in its own
        directory (the VM continues on top of them), its state (with `mode` FULL) goes to
        `dest` and its memory file to `memory_dir`, and the sealed disks are flattened into
        `dest`. The time of each step goes into `steps`."""
        live = self._live_of(record.id)
        seq = record.checkpoint_seq + 1
        staging = checkpoints.staging_dir(self._dirs(record.id)[0], seq)
        self.catalog.transition(record.id, [SandboxState.RUNNING], SandboxState.SNAPSHOTTING)
        try:
            await asyncio.to_thread(staging.mkdir)
            snap = await live.vm.snapshot(
                SnapshotTarget(staging, memory_dir), keep_running=True, machine_state=mode.memory
            )
        except _FAILURES as e:
            await asyncio.to_thread(shutil.rmtree, staging, True)
            raise OperationFailed(f"snapshot of sandbox {record.id} failed: {e}") from e
        finally:
            self.catalog.transition(
                record.id,
                [SandboxState.SNAPSHOTTING],
                SandboxState.RUNNING,
                checkpoint_seq=seq,
            )
        steps.mark("save")
        exported = await self.driver.export(snap, dest, move=True, memory_dir=memory_dir)
        steps.mark("export")
        return exported

    async def delete_template(self, template_id: str) -> None:
        """Delete a template or snapshot for users; its files go once no sandbox uses them."""
        self.templates.hide(template_id)
        for listener in list(self.template_deleted):
            await listener(template_id)
        await self.saved.collect()

    async def _launch_checkpoint(self, record: SandboxRecord, cold: bool) -> _Live:
        """Start a paused sandbox from its newest checkpoint; when the local one turns out
        unusable (a layer below it lost), from the repository's copy."""
        token = record.envd_access_token
        snapshot = await self.saved.paused_checkpoint(record)
        try:
            async with self.saved.push_held(record, snapshot):
                snapshot = await self._merged_before_restore(record, snapshot)
                return await self._launch(record, snapshot, current_token=token, cold=cold)
        except RestoreError:
            if self.saved.archive is None:
                raise
        snapshot = await self.saved.paused_checkpoint(record, pull=True)
        return await self._launch(record, snapshot, current_token=token, cold=cold)

    async def _merged_before_restore(self, record: SandboxRecord, snapshot: Snapshot) -> Snapshot:
        """The sandbox's local checkpoint with a chain of memory layers `MERGE_DEPTH` deep
        merged into one state first (`Detacher.merge`, adopted at once): the restore would
        compose the chain all the same, and the sandbox then lies over that one state, so
        its next pauses stay small layers. Without this, a sandbox resumed right after each
        pause (which stops the background merge) reached the chain's cap every few pauses,
        where a save writes all it changed since its base. The layered form when the merge
        fails, or for a copy pulled from the repository."""
        if len(snapshot.layers) < detach.MERGE_DEPTH:
            return snapshot
        directory = checkpoints.pause_dir(self._dirs(record.id)[0], record.checkpoint_seq)
        if snapshot.state_file.parent != directory:  # a copy pulled from the repository
            return snapshot
        merged = await self.detacher.merge(snapshot, directory)
        if merged is None:
            return snapshot
        await asyncio.to_thread(detach.adopt, directory, merged)
        return merged

    # -- network --------------------------------------------------------------------------

    async def check_network(self, network: SandboxNetwork) -> None:
        """Raise `InvalidNetwork` for settings no slot could honour: an egress proxy whose name
        does not resolve, or resolves into a range sandboxes may not reach or to an address of
        the node itself (E2B refuses these before the sandbox exists; the slot's proxy checks
        again at every connection), and a resolver of the sandbox's own in such a range (its
        DNS forwarder would never ask it; only the node's resolver may be private)."""
        denied = self.slots.denied
        for server in network.dns_servers or ():
            if any(IPv4Address(server) in n for n in denied):
                message = f"{server} is in a range sandboxes may not reach"
                raise InvalidNetwork("dnsServers", message)
        if network.egress_proxy is not None:
            try:
                await socks.resolve(network.egress_proxy, denied, self.slots.host_netns)
            except socks.TunnelError as e:
                raise InvalidNetwork("egressProxy", str(e)) from e

    async def set_egress(self, sandbox_id: str, rules: SandboxNetwork) -> SandboxRecord:
        """Replace the sandbox's egress rules by those of `rules` (`PUT /sandboxes/{id}/network`;
        its ingress settings stay). A running sandbox's slot changes at once, open connections
        included; a paused one gets the rules when it resumes. Raises OperationFailed when the
        slot refused the change: the old rules then stay, in the slot and in the catalog."""
        async with self._lock(sandbox_id):
            record = self.get(sandbox_id)
            if record.state not in (SandboxState.RUNNING, SandboxState.PAUSED, *ASLEEP):
                raise InvalidState(sandbox_id, record.state, "change the network of")
            network = dataclasses.replace(
                record.network,
                allow_internet=rules.allow_internet,
                allow_out=rules.allow_out,
                deny_out=rules.deny_out,
                egress_proxy=rules.egress_proxy,
                dns_servers=rules.dns_servers,
            )
            live = self._live.get(sandbox_id)
            if live is not None:
                await self._apply_egress(live.slot, record.network.egress, network.egress)
            updated = self.catalog.update(sandbox_id, network=network)
            assert updated is not None  # only this task changes a row it holds the lock of
            return updated

    async def _apply_egress(self, slot: Slot, old: SlotEgress, new: SlotEgress) -> None:
        try:
            await self.slots.set_policy(slot, new.policy)
            await self.slots.set_egress(slot, new.enabled)
        except (NftError, OSError) as e:
            with contextlib.suppress(NftError, OSError):
                await self.slots.set_policy(slot, old.policy)
                await self.slots.set_egress(slot, old.enabled)
            raise OperationFailed(f"could not change the network of slot {slot.netns}: {e}") from e

    # -- timeouts -------------------------------------------------------------------------

    def set_timeout(self, sandbox_id: str, timeout: int) -> SandboxRecord:
        """The sandbox now ends `timeout` seconds from now (shorter or longer than before)."""
        record = self.get(sandbox_id)
        updated = self.catalog.update(sandbox_id, end_at=time.time() + timeout)
        if updated is None:
            raise SandboxNotFound(sandbox_id)
        if record.state in LIVE | ASLEEP:  # a hibernated sandbox's timeout runs on
            self._schedule_expiry(updated)
        return updated

    def set_auto_pause(self, sandbox_id: str, auto_pause: bool) -> SandboxRecord:
        """What the sandbox's timeout does from now on: pause it (True) or kill it."""
        updated = self.catalog.update(sandbox_id, auto_pause=auto_pause)
        if updated is None:
            raise SandboxNotFound(sandbox_id)
        return updated

    def extend_timeout(self, sandbox_id: str, timeout: int) -> SandboxRecord:
        """Connect semantics: the end time only ever moves later."""
        record = self.get(sandbox_id)
        if record.end_at >= time.time() + timeout:
            return record
        return self.set_timeout(sandbox_id, timeout)

    def _schedule_expiry(self, record: SandboxRecord) -> None:
        self._cancel_timer(record.id)
        loop = asyncio.get_running_loop()
        delay = max(0.0, record.end_at - time.time())
        self._timers[record.id] = loop.call_later(delay, self._expire, record.id)

    def _cancel_timer(self, sandbox_id: str) -> None:
        timer = self._timers.pop(sandbox_id, None)
        if timer is not None:
            timer.cancel()

    def _expire(self, sandbox_id: str) -> None:
        self._timers.pop(sandbox_id, None)
        record = self.catalog.get(sandbox_id)
        if record is None or record.end_at > time.time() + 0.5:
            return  # moved meanwhile; its new timer is already set
        self._spawn(self._expire_now(record))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        """A background task's end: its failure is logged, never left unobserved."""
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background work failed", exc_info=task.exception())

    async def _expire_now(self, record: SandboxRecord) -> None:
        """Timeout: pause when the sandbox asked for it (`autoPause`), else kill."""
        log.info("sandbox %s timed out", record.id)
        if record.auto_pause:
            try:
                await self.pause(record.id, mode=record.auto_pause_mode)
                return
            except (SandboxNotFound, InvalidState):
                return
            except OperationFailed:
                log.exception("auto-pause of %s failed; killing it", record.id)
        await self.kill(record.id)


def _sandbox_env(record: SandboxRecord) -> dict[str, str]:
    """What every process in the sandbox sees (and envd `/envs` reports), as infra sets it."""
    return {
        **record.env_vars,
        "E2B_SANDBOX": "true",
        "E2B_SANDBOX_ID": record.id,
        "E2B_TEMPLATE_ID": record.template_id,
    }


def _traffic_token(network: SandboxNetwork) -> str | None:
    """A sandbox whose ports are not public gets a token of its own (forks too)."""
    return None if network.allow_public_traffic else new_access_token()


async def _rehearse_init(envd: EnvdClient, template: Template, sandbox_id: str) -> None:
    """Run `/init` once in a pooled VM as its take will (its future id, the template's env and
    token), so that the take's `/init` runs guest code TCG has translated already: a restored
    guest's first `/init` was most of a pool hit's create (40-80 ms of 90, bench/pool.py).
    The take's `/init` then replaces all of it (env, token, entropy, clock)."""
    env = {**template.env_vars, "E2B_SANDBOX": "true", "E2B_SANDBOX_ID": sandbox_id}
    await envd.init(
        new_token=template.envd_access_token,
        env_vars={**env, "E2B_TEMPLATE_ID": template.template_id},
        hostname=sandbox_id,
        timeout=RESTORE_READY_TIMEOUT,
        default_user=template.default_user,
        default_workdir=template.default_workdir,
    )


async def _warm_up(envd: EnvdClient, user: str) -> None:
    """Run what a sandbox's first SDK calls run (a command, a file read) once in a pooled VM,
    before any create takes it: a new VMM has translated none of that guest code under TCG,
    which made the first command of a sandbox ≈ 2x its later ones. Nothing of it is kept in
    the guest but what `/init` then replaces. A template without that user is not warmed."""
    try:
        await warm_up(envd, user)
    except (StepFailed, ConnectError, httpx.HTTPError) as e:
        log.info("pooled VM not warmed up: %s", e)
