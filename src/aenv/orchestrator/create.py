"""Creating a sandbox from a template, a snapshot or (fork children) a fork checkpoint.

1. Admit: the host's reserves, memory for the VM (pooled VMs given back first when that
   makes room), then the node's and the owner's sandbox counts. Counting and joining the
   queue happen with no await in between, so concurrent creates see each other. A create
   whose client asked to wait for room retries this step in `waiting`'s queue.
2. Queue: wait for one of `max_concurrent_creates` admissions, then check the disk (once
   admitted: a queued create holds no disk yet).
3. Insert the sandbox's row, state CREATING, under its lock.
4. Take a pooled VM of its template, or launch one from the saved state (`launch`).
5. CREATING -> RUNNING; its timeout, idle clock and VMM watch start; listeners are told.

A create that fails at 4 leaves nothing: every step registers its undo as it succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from aenv.ids import TEAM_ID, new_access_token, new_sandbox_id
from aenv.network.settings import SandboxNetwork
from aenv.orchestrator import capacity, ending, pooling
from aenv.orchestrator.catalog import SandboxRecord, VolumeMount
from aenv.orchestrator.errors import CapacityReached, CreateFailed
from aenv.orchestrator.events import EventType
from aenv.orchestrator.kinds import SaveMode, TemplateKind
from aenv.orchestrator.launch import launch
from aenv.orchestrator.node import FAILURES, Live, Node
from aenv.orchestrator.residency import tell
from aenv.orchestrator.states import SandboxState
from aenv.orchestrator.templates import Template

log = logging.getLogger("aenv.orchestrator")


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
    # Who asks (an API key's id), recorded with the sandbox.
    owner: str | None = None
    # Its team: the sandbox is the team's; at most `team_max_sandboxes` of a team's run at
    # once, within `team_max_disk_mb`.
    team_id: str = TEAM_ID
    # Volumes mounted into the guest (resolved by `VolumeStore.resolve`).
    volume_mounts: tuple[VolumeMount, ...] = ()
    # Seconds the client lets it wait for capacity (cut to `create_max_wait`); 0: refused
    # at once when there is no room.
    wait: float = 0.0
    # Set when the client goes away: a create still waiting for capacity leaves the queue.
    gone: asyncio.Event | None = dataclasses.field(default=None, compare=False)


async def create(node: Node, request: CreateRequest) -> tuple[SandboxRecord, Template]:
    # TemplateNotFound propagates (also for another team's private template). The node's own
    # sandboxes (build VMs) start from cached build steps whichever team's build made them.
    team = None if request.internal else request.team_id
    template = node.templates.get(request.template, team)
    record = await create_from(node, request, template, None)
    return record, template


async def create_from(
    node: Node, request: CreateRequest, base: Template, parent: SandboxRecord | None
) -> SandboxRecord:
    """A sandbox from `base`; for fork children, `parent` is the sandbox they fork."""
    need_mb = request.size[1] if request.size else (parent or base).memory_mb

    async def admit() -> None:
        await capacity.check_host(node)
        await _admit_memory(node, need_mb)
        capacity.check_counts(node, request.team_id, (parent or base).disk_size_mb)

    config = node.config
    wait = min(request.wait, config.create_max_wait)
    await node.waiting.admit(request.team_id, wait, config.create_max_waiters, admit, request.gone)
    # Rows exist from the moment a create is admitted; the queue holds the rest. Counting
    # (the last of `admit`) and joining the queue happen with no await in between (after
    # the checks before it, which await), so concurrent creates see each other and the
    # caps are exact.
    starting = node.starting
    team = request.team_id
    starting.count += 1
    starting.memory_mb += need_mb
    starting.by_team[team] += 1
    try:
        return await _queued(node, request, base, parent)
    finally:
        starting.count -= 1
        starting.memory_mb -= need_mb
        starting.by_team[team] -= 1
        if not starting.by_team[team]:
            del starting.by_team[team]
        starting.last_end = time.monotonic()
        node.waiting.changed()  # a create that failed leaves room


async def _admit_memory(node: Node, need_mb: int) -> None:
    """Raises CapacityReached when the host's memory has no room for one more sandbox,
    after giving back every pooled VM when that could make room."""
    refused = await capacity.memory_refusal(node, need_mb)
    if await pooling.give_back(node, refused):
        refused = await capacity.memory_refusal(node, need_mb)
    if refused is not None:
        node.stats.refused[refused[0]] += 1
        raise CapacityReached(f"no new sandboxes: {refused[1]}")


async def _queued(
    node: Node, request: CreateRequest, base: Template, parent: SandboxRecord | None
) -> SandboxRecord:
    """Step 2, then the create."""
    node.stats.queued += 1
    queued = time.perf_counter()
    try:
        await node.admission.acquire()
    finally:
        node.stats.queued -= 1
    waited_ms = (time.perf_counter() - queued) * 1000
    if waited_ms >= 1:  # only creates that found the admission full
        log.info("create from %s: %.0f ms in the queue", base.template_id, waited_ms)
    disk_mb = (parent or base).disk_size_mb
    try:
        # Checked once admitted, not in the queue: disks are thin, so a queued create
        # holds nothing yet (a burst of 200 on a 60 GiB host was refused when it counted),
        # while the ones starting together see each other's (counted with no await since
        # the check).
        await capacity.check_disk(node, disk_mb)
        node.starting.disk_mb += disk_mb
        try:
            with contextlib.ExitStack() as failed:
                failed.callback(_count_failure, node)
                record = await _create(node, request, base, parent)
                failed.pop_all()
        finally:
            node.starting.disk_mb -= disk_mb
    finally:
        node.admission.release()
    node.stats.succeeded += 1
    return record


def _count_failure(node: Node) -> None:
    node.stats.failed += 1


async def _create(
    node: Node, request: CreateRequest, base: Template, parent: SandboxRecord | None
) -> SandboxRecord:
    """Steps 3-5, on a pooled VM when its template's pool has one."""
    pooled = await pooling.take(node, base) if _poolable(node, request, base, parent) else None
    sandbox_id = pooled.sandbox_id if pooled else new_sandbox_id()
    async with node.lock(sandbox_id):
        record = node.catalog.insert(_new_record(sandbox_id, request, base, parent))
        async with contextlib.AsyncExitStack() as undo:
            undo.callback(node.catalog.delete, sandbox_id)
            undo.push_async_callback(node.reclaim_files, sandbox_id)
            try:
                live = await pooling.adopt(node, record, pooled, base) if pooled else None
                if live is None:
                    live = await _launch_base(node, record, request, base)
            except FAILURES as e:
                raise CreateFailed(
                    f"could not start sandbox from template {base.template_id}: {e}"
                ) from e
            undo.pop_all()
        running = node.catalog.transition(sandbox_id, [SandboxState.CREATING], SandboxState.RUNNING)
        assert running is not None  # only this task changes a row it holds the lock of
        ending.started(node, running, live)
        node.events.record(EventType.CREATED, running)
    if not running.internal:
        await tell(node.residency, lambda r: r.sandbox_routed(sandbox_id), f"{sandbox_id} came")
    return running


def _new_record(
    sandbox_id: str, request: CreateRequest, base: Template, parent: SandboxRecord | None
) -> SandboxRecord:
    now = time.time()
    shown = parent or base
    return SandboxRecord(
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
        team_id=request.team_id,
        volume_mounts=request.volume_mounts,
    )


def _poolable(
    node: Node, request: CreateRequest, base: Template, parent: SandboxRecord | None
) -> bool:
    """Whether a create can run on a pooled VM: one restored from a built template's full
    state, as it is. Snapshots and forks are restored once each, so a pool would only
    hold their memory longer; resized and build VMs are booted, and a VM that mounts
    volumes has them as its VMM's devices from its start."""
    return (
        node.pools.enabled
        and parent is None
        and request.size is None
        and not request.internal
        and not request.volume_mounts
        and base.kind is TemplateKind.TEMPLATE
        and base.save_mode is SaveMode.FULL
    )


async def _launch_base(
    node: Node, record: SandboxRecord, request: CreateRequest, base: Template
) -> Live:
    """Step 4 without a pooled VM: restore (or boot) a new VM from `base`."""
    snapshot = await node.saved.base_snapshot(base)
    if (served := node.saved.served_template(base)) is not None:
        node.saved.lazy.share(record.id, served)  # its saves wait for the files
    if request.size is not None:
        vcpus, memory_mib = request.size
        spec = dataclasses.replace(snapshot.spec, vcpus=vcpus, memory_mib=memory_mib)
        snapshot = dataclasses.replace(snapshot, spec=spec)
    return await launch(
        node,
        record,
        snapshot,
        current_token=base.envd_access_token,
        cold=base.save_mode is SaveMode.FILESYSTEM or request.size is not None,
    )


def _traffic_token(network: SandboxNetwork) -> str | None:
    """A sandbox whose ports are not public gets a token of its own (forks too)."""
    return None if network.allow_public_traffic else new_access_token()
