"""The sandbox lifecycle on one node: create (restore a template), kill, timeouts, lookups.

Every change of state goes through the catalog's conditional transition, so concurrent calls on
one sandbox converge (one kill wins, the rest see it gone) and a crash leaves either the old or
the new state. Creates pass an admission gate: a burst beyond `max_concurrent_creates` waits in
a queue instead of failing. The process-local part of a sandbox (its VM and network slot) lives
in `_live`; the catalog row is the durable part.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from aenv.config import Config
from aenv.ids import new_access_token, new_sandbox_id
from aenv.network import Slot, SlotProvider
from aenv.orchestrator import envd_client
from aenv.orchestrator.catalog import Catalog, SandboxRecord
from aenv.orchestrator.states import KILLABLE, LIVE, SandboxState
from aenv.orchestrator.templates import Template, TemplateStore
from aenv.runtime.driver import VM, Driver, DriverError, NetAttachment, RestoreSpec

log = logging.getLogger("aenv.orchestrator")

RESTORE_READY_TIMEOUT = 30.0


class SandboxNotFound(LookupError):
    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"sandbox {sandbox_id} not found")
        self.sandbox_id = sandbox_id


class CreateFailed(RuntimeError):
    """The sandbox could not be started; nothing of it is left."""


class CapacityReached(RuntimeError):
    """The node already holds `max_sandboxes` sandboxes."""


@dataclass
class CreateStats:
    """Counters for monitoring (the API exports them)."""

    queued: int = 0  # waiting for admission
    succeeded: int = 0
    failed: int = 0


@dataclass
class _Live:
    vm: VM
    slot: Slot


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
    allow_internet: bool = True


class Orchestrator:
    def __init__(
        self,
        config: Config,
        catalog: Catalog,
        driver: Driver,
        slots: SlotProvider,
        templates: TemplateStore,
    ) -> None:
        self.config = config
        self.catalog = catalog
        self.driver = driver
        self.slots = slots
        self.templates = templates
        self._live: dict[str, _Live] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._admission = asyncio.Semaphore(config.max_concurrent_creates)
        self.stats = CreateStats()
        self._client = httpx.AsyncClient()
        self._tasks: set[asyncio.Task[None]] = set()

    # -- start-up and shutdown ------------------------------------------------------------

    async def start(self) -> None:
        """Reclaim what a previous process left: no VM survives a restart of this server yet,
        so every row that claims a live sandbox is cleaned up and removed, never reported."""
        for record in self.catalog.list():
            log.warning("reclaiming sandbox %s left in state %s", record.id, record.state)
            await self._reclaim_files(record.id)
            self.catalog.delete(record.id)

    async def close(self) -> None:
        for sandbox_id in list(self._live):
            await self.kill(sandbox_id)
        for task in list(self._tasks):
            task.cancel()
        await self._client.aclose()

    # -- queries --------------------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxRecord:
        record = self.catalog.get(sandbox_id)
        if record is None or record.state.public is None:
            raise SandboxNotFound(sandbox_id)
        return record

    def list(self) -> list[SandboxRecord]:
        return [r for r in self.catalog.list() if r.state.public is not None]

    def guest_endpoint(self, sandbox_id: str) -> GuestEndpoint:
        """A running sandbox's endpoint (one catalog read: the proxy asks on every request)."""
        live = self._live.get(sandbox_id)
        record = self.catalog.get(sandbox_id)
        if live is None or record is None or record.state not in LIVE:
            raise SandboxNotFound(sandbox_id)
        return GuestEndpoint(str(live.slot.address), live.vm.id, record)

    def console_logs(self, sandbox_id: str) -> list[Path]:
        """The guest serial console output of every VM this sandbox has run in (one per
        create, resume or restore), oldest first."""
        self.get(sandbox_id)
        workdir, _ = self._dirs(sandbox_id)
        logs = [p for p in workdir.glob("**/console*.log") if p.is_file()]
        return sorted(logs, key=lambda p: p.stat().st_mtime)

    async def guest_metrics(self, sandbox_id: str) -> dict[str, float]:
        """envd's current resource sample from inside the guest (CPU, memory, disk)."""
        endpoint = self.guest_endpoint(sandbox_id)
        headers = {"X-Access-Token": endpoint.record.envd_access_token or ""}
        try:
            response = await self._client.get(
                f"http://{endpoint.host}:{envd_client.ENVD_PORT}/metrics",
                headers=headers,
                timeout=5.0,
            )
            response.raise_for_status()
        except httpx.HTTPError as e:
            raise envd_client.EnvdUnavailable(f"metrics of {sandbox_id}: {e}") from e
        sample: dict[str, float] = response.json()
        return sample

    # -- create ---------------------------------------------------------------------------

    async def create(self, request: CreateRequest) -> tuple[SandboxRecord, Template]:
        template = self.templates.get(request.template)  # TemplateNotFound propagates
        # Rows exist from the moment a create is admitted; the queue holds the rest. Checking and
        # joining the queue happen without an await in between, so the cap is exact.
        held = self.catalog.count(frozenset(SandboxState) - {SandboxState.DEAD}) + self.stats.queued
        if held >= self.config.max_sandboxes:
            raise CapacityReached(f"this node holds its maximum of {held} sandboxes")
        self.stats.queued += 1
        try:
            await self._admission.acquire()
        finally:
            self.stats.queued -= 1
        try:
            record = await self._create(request, template)
        except BaseException:
            self.stats.failed += 1
            raise
        finally:
            self._admission.release()
        self.stats.succeeded += 1
        return record, template

    async def _create(self, request: CreateRequest, template: Template) -> SandboxRecord:
        sandbox_id = new_sandbox_id()
        now = time.time()
        record = self.catalog.insert(
            SandboxRecord(
                id=sandbox_id,
                template_id=template.template_id,
                alias=template.aliases[0] if template.aliases else None,
                state=SandboxState.CREATING,
                cpu_count=template.cpu_count,
                memory_mb=template.memory_mb,
                disk_size_mb=template.disk_size_mb,
                started_at=now,
                end_at=now + request.timeout,
                metadata=dict(request.metadata),
                env_vars=dict(request.env_vars),
                envd_access_token=new_access_token(),
                auto_pause=request.auto_pause,
                allow_internet=request.allow_internet,
            )
        )
        workdir, memory_dir = self._dirs(sandbox_id)
        live: _Live | None = None
        slot: Slot | None = None
        try:
            workdir.mkdir(parents=True)
            memory_dir.mkdir(parents=True)
            slot = await self.slots.acquire(egress=request.allow_internet)
            vm = await self.driver.restore(
                template.snapshot(),
                RestoreSpec(
                    workdir=workdir,
                    net=NetAttachment(slot.netns, slot.guest.tap, slot.guest.mac),
                    memory_dir=memory_dir,
                ),
            )
            live = _Live(vm, slot)
            self._live[sandbox_id] = live
            await envd_client.init(
                self._client,
                f"http://{slot.address}:{envd_client.ENVD_PORT}",
                current_token=template.envd_access_token,
                new_token=record.envd_access_token,
                env_vars=_sandbox_env(record),
                hostname=sandbox_id,
                timeout=RESTORE_READY_TIMEOUT,
            )
        except (DriverError, envd_client.EnvdUnavailable, OSError) as e:
            await self._teardown(sandbox_id, live, slot)
            self.catalog.delete(sandbox_id)
            raise CreateFailed(
                f"could not start sandbox from template {template.template_id}: {e}"
            ) from e
        except BaseException:
            await self._teardown(sandbox_id, live, slot)
            self.catalog.delete(sandbox_id)
            raise
        running = self.catalog.transition(
            sandbox_id,
            [SandboxState.CREATING],
            SandboxState.RUNNING,
            placement={"workdir": str(workdir), "slot": slot.index, "netns": slot.netns},
        )
        if running is None:  # killed while starting
            await self._teardown(sandbox_id, live, slot)
            raise CreateFailed(f"sandbox {sandbox_id} was killed while starting")
        self._schedule_expiry(running)
        self._spawn(self._watch_vmm(sandbox_id, live.vm))
        return running

    async def _watch_vmm(self, sandbox_id: str, vm: VM) -> None:
        """A VMM that exits on its own (crash, OOM kill, kill -9) takes its sandbox with it: the
        sandbox is reported gone and its slot and files are released, other sandboxes untouched."""
        await vm.wait_exit()
        live = self._live.get(sandbox_id)
        record = self.catalog.get(sandbox_id)
        if live is None or live.vm is not vm or record is None or record.state not in LIVE:
            return  # a planned stop (kill, timeout) is already handling it
        log.warning("sandbox %s: its VMM exited unexpectedly; removing it", sandbox_id)
        await self.kill(sandbox_id)

    # -- kill and timeouts ------------------------------------------------------------------

    async def kill(self, sandbox_id: str) -> bool:
        """Stop and forget a sandbox. False when it does not exist (or is already going)."""
        record = self.catalog.transition(sandbox_id, KILLABLE, SandboxState.KILLING)
        if record is None:
            return False
        timer = self._timers.pop(sandbox_id, None)
        if timer is not None:
            timer.cancel()
        live = self._live.get(sandbox_id)
        await self._teardown(sandbox_id, live, live.slot if live else None)
        self.catalog.delete(sandbox_id)
        return True

    async def _teardown(self, sandbox_id: str, live: _Live | None, slot: Slot | None) -> None:
        self._live.pop(sandbox_id, None)
        if live is not None:
            with contextlib.suppress(DriverError):
                await live.vm.stop()
        if slot is not None:
            await self.slots.release(slot)
        await self._reclaim_files(sandbox_id)

    def _dirs(self, sandbox_id: str) -> tuple[Path, Path]:
        """A sandbox's VM work directory and its memory directory (on tmpfs)."""
        return (
            self.config.sandboxes_dir / sandbox_id,
            self.templates.memory_dir / "sandboxes" / sandbox_id,
        )

    async def _reclaim_files(self, sandbox_id: str) -> None:
        for path in self._dirs(sandbox_id):
            await asyncio.to_thread(shutil.rmtree, path, True)

    def set_timeout(self, sandbox_id: str, timeout: int) -> SandboxRecord:
        """The sandbox now ends `timeout` seconds from now (shorter or longer than before)."""
        record = self.get(sandbox_id)
        updated = self.catalog.update(sandbox_id, end_at=time.time() + timeout)
        if updated is None:
            raise SandboxNotFound(sandbox_id)
        if record.state in LIVE:
            self._schedule_expiry(updated)
        return updated

    def extend_timeout(self, sandbox_id: str, timeout: int) -> SandboxRecord:
        """Connect semantics: the end time only ever moves later."""
        record = self.get(sandbox_id)
        if record.end_at >= time.time() + timeout:
            return record
        return self.set_timeout(sandbox_id, timeout)

    def _schedule_expiry(self, record: SandboxRecord) -> None:
        old = self._timers.pop(record.id, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        delay = max(0.0, record.end_at - time.time())
        self._timers[record.id] = loop.call_later(delay, self._expire, record.id)

    def _expire(self, sandbox_id: str) -> None:
        self._timers.pop(sandbox_id, None)
        record = self.catalog.get(sandbox_id)
        if record is None or record.end_at > time.time() + 0.5:
            return  # moved meanwhile; its new timer is already set
        self._spawn(self._expire_now(sandbox_id))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _expire_now(self, sandbox_id: str) -> None:
        # Auto-pause on timeout arrives with pause/resume; until then expiry kills.
        log.info("sandbox %s timed out", sandbox_id)
        await self.kill(sandbox_id)


def _sandbox_env(record: SandboxRecord) -> dict[str, str]:
    """What every process in the sandbox sees (and envd `/envs` reports), as infra sets it."""
    return {
        **record.env_vars,
        "E2B_SANDBOX": "true",
        "E2B_SANDBOX_ID": record.id,
        "E2B_TEMPLATE_ID": record.template_id,
    }
