"""The warm pools' VMs: restoring them ahead of creates, a create taking one, and giving
them back (`warm` keeps the books: which pooled VMs exist and how many each template wants).

A refill restores one VM at a time, between creates:
1. Pin the template's saved build and mark the VM's directory as pooled.
2. Restore the VM through admission, on a slot with no egress.
3. Warm its guest code up and rehearse the take's `/init`, then add it to the pool.

A take (`adopt`) gives the pooled VM the sandbox's egress rules, then runs `/init`; a pooled
VM that fails then is stopped and removed, and the create restores a VM of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import httpx
from connectrpc.errors import ConnectError

from aenv.ids import new_sandbox_id
from aenv.network import EgressPolicy
from aenv.network.settings import SlotEgress
from aenv.orchestrator import capacity, warm
from aenv.orchestrator.admission import Refusal
from aenv.orchestrator.build_steps import StepFailed, warm_up
from aenv.orchestrator.catalog import SandboxRecord
from aenv.orchestrator.envd_client import EnvdClient
from aenv.orchestrator.errors import OperationFailed
from aenv.orchestrator.identity import slot_egress
from aenv.orchestrator.kinds import TemplateKind
from aenv.orchestrator.launch import RESTORE_READY_TIMEOUT, init_envd, start_vm
from aenv.orchestrator.network_updates import apply_egress
from aenv.orchestrator.node import FAILURES, Live, Node
from aenv.orchestrator.templates import Template
from aenv.orchestrator.warm import Pooled

log = logging.getLogger("aenv.orchestrator")

# Seconds between two looks of the refill at pools nobody created from (to shrink them).
REFILL_IDLE = 10.0
# A refill waits until no create has been under way for this long: its restore would compete
# for the CPU with the create and with the new sandbox's first commands.
REFILL_QUIET = 1.0
# What a pooled VM's slot is given until a create takes it: no egress at all.
NO_EGRESS = SlotEgress(enabled=False, policy=EgressPolicy())


async def take(node: Node, base: Template) -> Pooled | None:
    """A pooled VM of `base`'s current build for a create, if its pool has one; the create
    is counted, so the pool grows to meet the template's creates."""
    node.pools.note_create(base.template_id)
    node.pool_wake.set()
    pooled, stale = node.pools.take(base.template_id, base.build_id)
    for old in stale:
        await discard(node, old)
    return pooled


async def adopt(node: Node, record: SandboxRecord, pooled: Pooled, base: Template) -> Live | None:
    """Make a pooled VM the sandbox's: its egress rules on the slot, then envd `/init`.
    None when the pooled VM failed (it is gone; the caller restores a new one)."""
    async with contextlib.AsyncExitStack() as undo:
        undo.push_async_callback(discard, node, pooled)
        try:
            start = time.perf_counter()
            await apply_egress(node, pooled.slot, NO_EGRESS, slot_egress(record))
            egress = time.perf_counter()
            envd = EnvdClient(node.client, str(pooled.slot.address), base.envd_access_token)
            await init_envd(node, record, envd)
            log.info(
                "pool hit %s: egress %.1f ms, /init %.1f ms",
                record.id,
                (egress - start) * 1000,
                (time.perf_counter() - egress) * 1000,
            )
        except (*FAILURES, OperationFailed) as e:
            log.warning("pooled VM %s failed at its take, restoring anew: %s", record.id, e)
            return None
        undo.pop_all()
    pooled.pin.close()  # the sandbox's row names the saved build now
    await asyncio.to_thread((node.dirs(record.id)[0] / warm.MARKER).unlink)
    live = Live(pooled.vm, pooled.slot)
    node.live[record.id] = live
    return live


async def discard(node: Node, pooled: Pooled) -> None:
    """Stop a pooled VM and remove all of it."""
    await node.stop_vm(pooled.vm, pooled.slot)
    await node.reclaim_files(pooled.sandbox_id)
    pooled.pin.close()


async def give_back(node: Node, refused: tuple[Refusal, str] | None) -> bool:
    """Stop every pooled VM when the host is short of available memory; whether any was."""
    if refused is None or refused[0] is not Refusal.MEMORY or not any(node.pools):
        return False
    for pooled in list(node.pools):
        node.pools.evict(pooled)
        await discard(node, pooled)
    return True


async def refill_forever(node: Node) -> None:
    """Keep every pool at its target, one restore at a time and only between creates;
    shrink pools whose template's creates slowed down; give every pooled VM back when the
    host runs short of memory."""
    while True:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(REFILL_IDLE):
                await node.pool_wake.wait()
        node.pool_wake.clear()
        await give_back(node, await capacity.memory_refusal(node, 0))
        for pooled in node.pools.surplus():
            await discard(node, pooled)
        for template_id in node.pools.missing():
            await _creates_quiet(node)
            if not await _fill(node, template_id):
                break


async def _creates_quiet(node: Node) -> None:
    """Wait until no create runs or ended in the last `REFILL_QUIET` seconds. A node busy
    with creates back to back thus refills nothing: its creates miss and restore as
    without pools, no slower, instead of sharing the CPU with restores for the pool."""
    while True:
        quiet_for = time.monotonic() - node.starting.last_end
        if not node.starting.count and quiet_for >= REFILL_QUIET:
            return
        await asyncio.sleep(max(REFILL_QUIET - quiet_for, 0.05))


async def _fill(node: Node, template_id: str) -> bool:
    """Restore one VM into the template's pool. False when it cannot now (no memory, the
    template gone or failing); the next wake tries again."""
    template = node.templates.by_id(template_id)
    if template is None or template.kind is not TemplateKind.TEMPLATE:
        return False
    refused = await capacity.memory_refusal(node, template.memory_mb, pooling=True)
    if refused is not None:
        log.info("pool of %s not refilled: %s", template_id, refused[1])
        return False
    pooled = await _restore_pooled(node, template)
    if pooled is None:
        return False
    node.pools.add(pooled)
    return True


async def _restore_pooled(node: Node, template: Template) -> Pooled | None:
    """Steps 1-3 of a refill. None when the restore failed (nothing of it is left)."""
    sandbox_id = new_sandbox_id()
    workdir = node.dirs(sandbox_id)[0]
    pin = contextlib.ExitStack()
    pin.enter_context(node.saved.pin(Path(template.snapshot_dir)))
    node.pools.filling[template.template_id] += 1
    try:
        async with contextlib.AsyncExitStack() as undo:
            undo.callback(pin.close)
            undo.push_async_callback(node.reclaim_files, sandbox_id)
            try:
                await asyncio.to_thread(workdir.mkdir, parents=True)
                await asyncio.to_thread((workdir / warm.MARKER).touch)
                async with node.admission:
                    snapshot = await node.saved.base_snapshot(template)
                    if (served := node.saved.served_template(template)) is not None:
                        node.saved.lazy.share(sandbox_id, served)  # saves wait for the files
                    token = template.envd_access_token
                    vm, slot, envd = await start_vm(
                        node, sandbox_id, snapshot, NO_EGRESS, token, cold=False
                    )
                undo.push_async_callback(node.stop_vm, vm, slot)
                await envd.wait_healthy(RESTORE_READY_TIMEOUT)
                await _warm_up(envd, template.default_user or "user")
                await _rehearse_init(envd, template, sandbox_id)
            except FAILURES as e:
                log.warning("pool of %s: restore failed: %s", template.template_id, e)
                return None
            undo.pop_all()
    finally:
        node.pools.filling[template.template_id] -= 1
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
