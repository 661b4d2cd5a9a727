"""The state every sandbox operation of one node shares (`Node`), and the few acts they all
use on it: a sandbox's lock, its directories, its VM, its timeout timer, stopping a VM.

The catalog row and the sandbox's directory are the durable part of a sandbox; its VM and
network slot (`Live`) are the process-local part, in `Node.live`. Every operation on one
sandbox runs under that sandbox's lock (`Node.lock`), so concurrent calls converge: pause
racing resume racing kill each run whole, in some order, and later ones see the state the
earlier ones left. The operations themselves live in a module each (create, save, restore,
fork, ending, ...), as functions of a `Node`; `lifecycle.Orchestrator` is their facade.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from aenv.config import Config, Paths
from aenv.network import Slot, SlotProvider
from aenv.orchestrator.admission import Refusal
from aenv.orchestrator.background import PerSandbox
from aenv.orchestrator.catalog import Catalog, SandboxRecord
from aenv.orchestrator.detach import Detacher
from aenv.orchestrator.envd_client import EnvdClient, EnvdUnavailable, http_client
from aenv.orchestrator.errors import SandboxNotFound
from aenv.orchestrator.events import EventLog
from aenv.orchestrator.hibernation import Hibernation
from aenv.orchestrator.locks import KeyedLocks
from aenv.orchestrator.metrics_history import MetricsHistory
from aenv.orchestrator.reserve import HostReserve
from aenv.orchestrator.residency import ResidencyListener
from aenv.orchestrator.saved import SavedStates
from aenv.orchestrator.templates import TemplateStore
from aenv.orchestrator.volumes import VolumeStore
from aenv.orchestrator.waiting import WaitQueue
from aenv.orchestrator.warm import WarmPools
from aenv.orchestrator.webhook_delivery import WebhookDispatcher
from aenv.runtime.driver import VM, Driver, DriverError
from aenv.storage.repository import RepositoryError

log = logging.getLogger("aenv.orchestrator")

# What a failed VM, guest, file or repository step raises: an operation turns these into its
# own failure (`CreateFailed`, `OperationFailed`), with the sandbox left as it was.
FAILURES = (DriverError, EnvdUnavailable, OSError, RepositoryError)


def host_reserve(config: Config) -> HostReserve:
    """The disk and memory the host keeps, under the current settings."""
    return HostReserve(config.home, config.reserve_disk_mb, config.reserve_memory_mb)


async def remove_tree(path: Path) -> None:
    """Remove a directory and all in it, if it exists (in a thread: it can be large)."""
    await asyncio.to_thread(shutil.rmtree, path, True)


@dataclass
class Live:
    """A sandbox's VM and network slot, while it runs."""

    vm: VM
    slot: Slot
    # Set before the VMM is stopped on purpose (pause, kill), so its exit is not a crash.
    planned_exit: bool = False


@dataclass
class CreateStats:
    """Counters for monitoring (the API exports them)."""

    queued: int = 0  # waiting for admission
    succeeded: int = 0
    failed: int = 0
    refused: collections.Counter[Refusal] = dataclasses.field(default_factory=collections.Counter)


@dataclass
class Starting:
    """Creates queued or starting: their rows (if any yet, in state creating) hold no VM yet,
    so admission counts them here."""

    count: int = 0
    memory_mb: int = 0
    by_team: collections.Counter[str] = field(default_factory=collections.Counter)
    # Disk of the creates admitted and not finished: their layers have not grown yet.
    disk_mb: int = 0
    # time.monotonic() when the latest create ended.
    last_end: float = 0.0


# What a sandbox's timeout runs (`ending.expire`), and what removes a sandbox whose VM
# vanished (`ending.remove_vanished`). The node is given them: they end sandboxes, which is
# the business of a module above this one.
OnTimeout = Callable[["Node", SandboxRecord], Coroutine[Any, Any, None]]
OnVanished = Callable[["Node", str], Coroutine[Any, Any, None]]


@dataclass(eq=False)
class Node:
    config: Config
    # `config.paths` with the template store's memory root.
    paths: Paths
    catalog: Catalog
    driver: Driver
    slots: SlotProvider
    templates: TemplateStore
    saved: SavedStates
    detacher: Detacher
    volumes: VolumeStore
    on_timeout: OnTimeout
    on_vanished: OnVanished
    pools: WarmPools
    hibernation: Hibernation
    # Lifecycle events, written by the operations as they change a sandbox's state, and
    # their deliveries to webhooks.
    events: EventLog
    webhooks: WebhookDispatcher
    # Creates running at once; more wait in its queue.
    admission: asyncio.Semaphore
    client: httpx.AsyncClient = field(default_factory=http_client)
    stats: CreateStats = field(default_factory=CreateStats)
    starting: Starting = field(default_factory=Starting)
    # Creates waiting for capacity (their clients asked to), woken as the catalog changes.
    waiting: WaitQueue = field(default_factory=WaitQueue)
    metrics: MetricsHistory = field(default_factory=MetricsHistory)
    locks: KeyedLocks = field(default_factory=KeyedLocks)
    live: dict[str, Live] = field(default_factory=dict)
    # Slots of VMs being stopped (out of `live` already, not released yet): still held, so
    # the reconciler must not take them for leaked and release them a second time.
    stopping: dict[int, Slot] = field(default_factory=dict)
    timers: dict[str, asyncio.TimerHandle] = field(default_factory=dict)
    # The work after a pause (`save.settle`): detach, then upload.
    settling: PerSandbox = field(default_factory=lambda: PerSandbox("work after the pause"))
    # Set when a pool may want a refill (a create from its template).
    pool_wake: asyncio.Event = field(default_factory=asyncio.Event)
    refiller: asyncio.Task[None] | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    # Told (sandbox id, VM id) whenever a sandbox's VM stops, whatever the reason: the proxy
    # ends the connections to that VM at once.
    vm_stopped: list[Callable[[str, str], None]] = field(default_factory=list)
    # Told which sandboxes come and go (a cluster node's agent), see `residency`.
    residency: list[ResidencyListener] = field(default_factory=list)
    # Run with every reconcile round: the housekeeping of what lives beside the
    # orchestrator (the template builder's uploads).
    chores: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # Told the id of each template deleted for users: what others keep of it goes with it
    # (the builder's records, logs and uploads).
    template_deleted: list[Callable[[str], Awaitable[None]]] = field(default_factory=list)

    def lock(self, sandbox_id: str) -> contextlib.AbstractAsyncContextManager[None]:
        return self.locks.hold(sandbox_id)

    def get(self, sandbox_id: str) -> SandboxRecord:
        """The record of a sandbox users can see; `SandboxNotFound` otherwise."""
        record = self.catalog.get(sandbox_id)
        if record is None or record.state.public is None:
            raise SandboxNotFound(sandbox_id)
        return record

    def dirs(self, sandbox_id: str) -> tuple[Path, Path]:
        """A sandbox's directory (VM work dir, checkpoints) and its memory directory (tmpfs)."""
        return self.paths.sandbox(sandbox_id), self.paths.sandbox_memory(sandbox_id)

    async def reclaim_files(self, sandbox_id: str) -> None:
        await self.saved.lazy.forget(sandbox_id)  # its mounts, if any, are in its directory
        for path in self.dirs(sandbox_id):
            await remove_tree(path)

    def reserve(self) -> HostReserve:
        return host_reserve(self.config)

    def live_of(self, sandbox_id: str) -> Live:
        """The VM of a sandbox whose row says it runs (the caller holds its lock). Raises
        `SandboxNotFound` when it has none (its VM vanished between reconcile passes): the
        sandbox is gone for its users, as when its VMM exits, and is removed once the lock is
        free, with whatever of its VM and slot is left."""
        live = self.live.get(sandbox_id)
        if live is None:
            log.warning("sandbox %s: running without a VM; removing it", sandbox_id)
            self.spawn(self.on_vanished(self, sandbox_id))
            raise SandboxNotFound(sandbox_id)
        return live

    def envd_of(self, record: SandboxRecord) -> EnvdClient:
        """A live sandbox's envd (the caller holds its lock, so the VM is there)."""
        live = self.live_of(record.id)
        return EnvdClient(self.client, str(live.slot.address), record.envd_access_token)

    async def stop_vm(self, vm: VM, slot: Slot) -> None:
        """Stop a VM and release its slot, which stays held (`reconcile`) until released."""
        self.stopping[slot.index] = slot
        try:
            with contextlib.suppress(DriverError):
                await vm.stop()
            await self.slots.release(slot)
        finally:
            del self.stopping[slot.index]

    async def stop(self, sandbox_id: str, live: Live) -> None:
        """Stop a sandbox's VM on purpose, its listeners told first."""
        live.planned_exit = True
        for listener in self.vm_stopped:
            listener(sandbox_id, live.vm.id)
        await self.stop_vm(live.vm, live.slot)

    def schedule_expiry(self, record: SandboxRecord) -> None:
        self.cancel_timer(record.id)
        loop = asyncio.get_running_loop()
        delay = max(0.0, record.end_at - time.time())
        self.timers[record.id] = loop.call_later(delay, self._expire, record.id)

    def cancel_timer(self, sandbox_id: str) -> None:
        timer = self.timers.pop(sandbox_id, None)
        if timer is not None:
            timer.cancel()

    def _expire(self, sandbox_id: str) -> None:
        self.timers.pop(sandbox_id, None)
        record = self.catalog.get(sandbox_id)
        if record is None or record.end_at > time.time() + 0.5:
            return  # moved meanwhile; its new timer is already set
        self.spawn(self.on_timeout(self, record))

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        """A background task's end: its failure is logged, never left unobserved."""
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background work failed", exc_info=task.exception())
