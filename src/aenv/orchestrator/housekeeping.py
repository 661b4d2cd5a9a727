"""What runs for as long as the node does: console files kept bounded, what no sandbox owns
ended (`reconcile`), lifecycle events past their retention removed, the chores of what lives
beside the orchestrator, and the metrics history's samples."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

from aenv.network import SlotReclaimer
from aenv.orchestrator import consoles, metrics_history
from aenv.orchestrator.envd_client import EnvdUnavailable
from aenv.orchestrator.errors import SandboxNotFound
from aenv.orchestrator.node import Node
from aenv.orchestrator.queries import guest_metrics
from aenv.orchestrator.states import LIVE, SandboxState
from aenv.runtime.driver import VM, CPUTime, DriverError
from aenv.runtime.sweep import Reaper, reap_strays

log = logging.getLogger("aenv.orchestrator")

# Housekeeping rounds (`consoles.INTERVAL` apart) between two reconciliations.
RECONCILE_EVERY = 6


async def housekeeping(node: Node) -> None:
    """Keep every live VM's console file bounded, and every `RECONCILE_EVERY` rounds end
    what no sandbox owns (`reconcile`), remove the events past their retention and run the
    `chores`."""
    rounds = 0
    while True:
        await asyncio.sleep(consoles.INTERVAL)
        for live in list(node.live.values()):
            await asyncio.to_thread(consoles.cap, live.vm.console_log)
        rounds += 1
        if rounds % RECONCILE_EVERY == 0:
            await reconcile(node)
            node.events.sweep(node.config.events_retention_days)
            for chore in list(node.chores):
                try:
                    await chore()
                except Exception:  # one failed chore must not end the housekeeping
                    log.exception("housekeeping chore %s failed", chore)


async def reconcile(node: Node) -> None:
    """End what the catalog does not own: a live VM whose sandbox is not running any more
    (stopped, its slot released), VMMs and cgroups no VM object stands for (a failed or
    cancelled operation that dropped one without stopping it), VMMs of this node that this
    process did not start (a killed server's), and network slots nothing holds any more."""
    for sandbox_id in list(node.live):
        async with node.lock(sandbox_id):
            record = node.catalog.get(sandbox_id)
            if record is not None and record.state in LIVE:
                continue
            live = node.live.pop(sandbox_id, None)
            if live is not None:
                log.warning("sandbox %s: its VM outlived it; stopping it", sandbox_id)
                await node.stop(sandbox_id, live)
            if record is None:  # nothing names its files any more either
                await node.reclaim_files(sandbox_id)
    if isinstance(node.driver, Reaper):
        await asyncio.to_thread(node.driver.reap_unowned)
    await asyncio.to_thread(reap_strays, node.config.home)
    if isinstance(node.slots, SlotReclaimer):
        held = [live.slot for live in node.live.values()] + list(node.stopping.values())
        held += [pooled.slot for pooled in node.pools]
        await node.slots.reclaim_leaked(held)


async def sample_forever(node: Node) -> None:
    while True:
        await asyncio.sleep(node.metrics.interval)
        await sample_metrics(node)


async def sample_metrics(node: Node) -> None:
    """One round of the metrics history: a sample of every running sandbox (its VMM's CPU
    read on the host, its guest asked only when `MetricsHistory.needs_guest` says so); the
    history of sandboxes that are gone is dropped. A guest that does not answer when asked
    misses this round."""
    records = node.catalog.list()
    running = [r.id for r in records if r.state is SandboxState.RUNNING and not r.internal]
    readings = await asyncio.to_thread(_cpu_times, _vms_of(node, running))
    gate = asyncio.Semaphore(metrics_history.CONCURRENCY)

    async def sample(sandbox_id: str, cpu: CPUTime) -> None:
        with contextlib.suppress(SandboxNotFound, EnvdUnavailable):
            await _sample(node, sandbox_id, cpu, gate)

    await asyncio.gather(*(sample(i, cpu) for i, cpu in readings.items()))
    node.metrics.keep_only([r.id for r in records])


async def sample_now(node: Node, sandbox_id: str) -> metrics_history.Sample:
    """A sample of a running sandbox taken now and added to its history. Raises
    `SandboxNotFound` when it has no VM, `EnvdUnavailable` when its guest must be asked and
    does not answer."""
    readings = await asyncio.to_thread(_cpu_times, _vms_of(node, [sandbox_id]))
    if sandbox_id not in readings:
        raise SandboxNotFound(sandbox_id)
    return await _sample(node, sandbox_id, readings[sandbox_id], None)


async def _sample(
    node: Node, sandbox_id: str, cpu: CPUTime, gate: asyncio.Semaphore | None
) -> metrics_history.Sample:
    guest = None
    if node.metrics.needs_guest(sandbox_id, cpu):
        async with gate or contextlib.nullcontext():
            guest = await guest_metrics(node, sandbox_id)
    return node.metrics.record(sandbox_id, cpu, guest)


def _vms_of(node: Node, sandbox_ids: list[str]) -> dict[str, VM]:
    return {i: live.vm for i in sandbox_ids if (live := node.live.get(i)) is not None}


def _cpu_times(vms: Mapping[str, VM]) -> dict[str, CPUTime]:
    """The VMM CPU time of each VM still running (in a thread: one small /proc read each)."""
    found = {}
    for sandbox_id, vm in vms.items():
        with contextlib.suppress(DriverError):
            found[sandbox_id] = vm.cpu_time()
    return found
