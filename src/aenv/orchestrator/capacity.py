"""Whether the node has room for more: sandbox counts (the node's and an owner's), host
memory for one more VM, disk for new writable layers, and the host reserves a save keeps.

Each check raises when there is no room (`CapacityReached`, or `OperationFailed` for a save)
and counts the refusal; none changes anything. The policy itself (budgets, reserves) is in
`admission` and `reserve`; this module applies it to what the node holds now.
"""

from __future__ import annotations

import asyncio

from aenv.orchestrator.admission import HostMemory, MemoryBudget, Refusal
from aenv.orchestrator.catalog import Catalog
from aenv.orchestrator.errors import CapacityReached, OperationFailed, OwnerLimitReached
from aenv.orchestrator.node import Node
from aenv.orchestrator.states import LIVE, SandboxState


def check_counts(node: Node, team_id: str, disk_mb: int = 0) -> None:
    """Raises CapacityReached when the node holds `max_sandboxes`, when `team_id` runs
    `team_max_sandboxes` (queued creates included), or when one more sandbox of `disk_mb` would
    take the team's sandboxes and volumes past `team_max_disk_mb`."""
    config = node.config
    made = node.catalog.count(frozenset(SandboxState) - {SandboxState.CREATING})
    held = made + node.starting.count
    if held >= config.max_sandboxes:
        node.stats.refused[Refusal.SANDBOXES] += 1
        raise CapacityReached(f"this node holds its maximum of {held} sandboxes")
    if running_of(node, team_id) >= config.team_max_sandboxes:
        node.stats.refused[Refusal.TEAM] += 1
        raise OwnerLimitReached(
            "You have reached the maximum number of concurrent sandboxes for this team "
            f"({config.team_max_sandboxes})"
        )
    used = disk_of(node.catalog, team_id)
    if used + disk_mb > config.team_max_disk_mb:
        node.stats.refused[Refusal.TEAM] += 1
        raise OwnerLimitReached(
            f"this team's sandboxes and volumes hold {used} MiB of disk; one more of {disk_mb}"
            f" MiB would pass its limit of {config.team_max_disk_mb} MiB"
        )


def running_of(node: Node, team_id: str) -> int:
    """Sandboxes of `team_id` that are not paused, and its creates under way (queued or
    starting: a starting one's row, in state creating, is not counted twice)."""
    running = [
        r
        for r in node.catalog.list()
        if r.team_id == team_id and not r.internal and r.state.public not in (None, "paused")
    ]
    return len(running) + node.starting.by_team[team_id]


def disk_of(catalog: Catalog, team_id: str) -> int:
    """The disk (MiB) `team_id`'s sandboxes (paused ones too) and sized volumes may take."""
    sandboxes = sum(
        r.disk_size_mb
        for r in catalog.list()
        if r.team_id == team_id and not r.internal and r.state.public is not None
    )
    return sandboxes + sum(v.size_mb or 0 for v in catalog.volumes(team_id))


async def memory_refusal(
    node: Node, need_mb: int, *, pooling: bool = False
) -> tuple[Refusal, str] | None:
    """Why a VM of `need_mb` guest RAM does not fit in memory now (see `admission`).
    A pool refill (`pooling`) also leaves room for one create and counts pooled VMs."""
    config = node.config
    budget = MemoryBudget(
        config.reserve_memory_mb, config.admission_sandbox_mb, config.memory_overcommit
    )
    holding = LIVE | {SandboxState.RESUMING}
    nominal = sum(r.memory_mb for r in node.catalog.list(holding)) + node.starting.memory_mb
    starting = node.starting.count + sum(node.pools.filling.values())
    if pooling:
        nominal += sum(p.memory_mb for p in node.pools)
        starting += 1
    host = await asyncio.to_thread(HostMemory.now)
    return budget.refusal(host, starting=starting, nominal_mb=nominal, need_mb=need_mb)


async def check_host(node: Node) -> None:
    """Raises CapacityReached when the host is under its disk or memory reserve."""
    short = await asyncio.to_thread(node.reserve().shortfall)
    if short is not None:
        node.stats.refused[Refusal.DISK if "disk" in short else Refusal.MEMORY] += 1
        raise CapacityReached(f"no new sandboxes: {short}")


async def check_disk(node: Node, need_mb: int) -> None:
    """Raises CapacityReached when new sandboxes that can write `need_mb` (each one's
    writable layer is bounded at its disk size), on top of the creates starting, do not
    fit in the data filesystem's free space above the reserve. A caller that counts
    `need_mb` right after it races no other create."""
    reserve = node.reserve()
    free_mb = await asyncio.to_thread(reserve.free_disk_mb)
    short = reserve.disk_shortfall(free_mb, node.starting.disk_mb + need_mb)
    if short is not None:
        node.stats.refused[Refusal.DISK] += 1
        raise CapacityReached(f"no new sandboxes: {short}")


async def check_reserve(node: Node, what: str) -> None:
    """Raises OperationFailed when the host is under a reserve (nothing changed yet)."""
    short = await asyncio.to_thread(node.reserve().shortfall)
    if short is not None:
        raise OperationFailed(f"cannot {what}: {short}")
