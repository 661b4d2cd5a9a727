"""Starting a sandbox's VM from a saved state: a network slot, the VM restored (or booted from
its disks alone) in the sandbox's directories, then envd handed the sandbox's identity.

1. Acquire a network slot with the sandbox's egress.
2. Restore the VM from the snapshot, or boot it cold from its disks (a fresh envd, no token).
3. `/init`: envd gets the sandbox's token, env, hostname, volumes and fresh entropy; with
   header rules, then the node's egress CA.

Every step registers its undo once it succeeded (`contextlib.AsyncExitStack`): a failure
leaves nothing of the VM or slot. The sandbox's files are the caller's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aenv.network import Slot
from aenv.network.settings import SlotEgress
from aenv.orchestrator.catalog import SandboxRecord
from aenv.orchestrator.envd_client import EnvdClient
from aenv.orchestrator.identity import slot_egress
from aenv.orchestrator.node import Live, Node
from aenv.orchestrator.templates import BOOT_READY_TIMEOUT
from aenv.orchestrator.volumes import guest_mounts
from aenv.runtime.driver import VM, DriverError, NetAttachment, RestoreSpec, Share, Snapshot
from aenv.timing import Steps

log = logging.getLogger("aenv.orchestrator")

# A restored guest answers in milliseconds under KVM, but under emulation on a saturated host
# (hundreds of creates queued on two cores) it can take tens of seconds: a create should then
# be slow, not fail.
RESTORE_READY_TIMEOUT = 120.0


async def launch(
    node: Node,
    record: SandboxRecord,
    snapshot: Snapshot,
    *,
    current_token: str | None,
    cold: bool,
) -> Live:
    """Start a VM for `record` from `snapshot` (restored, or `cold`-booted from its disks
    alone) on a new network slot, and hand envd the sandbox's token, env and fresh entropy.
    A sandbox with volumes is restored when `snapshot` has enough share slots (templates
    built since they came), else booted: a restored VM has only its snapshot's devices.
    On failure nothing of the VM or slot is left; the sandbox's files are the caller's.
    Raises `VolumeNotFound` when a volume it mounts was deleted (nothing started)."""
    steps = Steps()
    shares = node.volumes.shares(record.volume_mounts)
    vm, slot, envd = await start_vm(
        node,
        record.id,
        snapshot,
        slot_egress(record),
        current_token,
        cold or len(shares) > snapshot.spec.share_slots,
        shares,
        steps,
    )
    async with contextlib.AsyncExitStack() as undo:
        undo.push_async_callback(node.stop_vm, vm, slot)
        await init_envd(node, record, envd)
        undo.pop_all()
    steps.mark("/init")
    log.info("started sandbox %s on VM %s: %s", record.id, vm.id, steps)
    live = Live(vm, slot)
    node.live[record.id] = live
    return live


async def start_vm(
    node: Node,
    sandbox_id: str,
    snapshot: Snapshot,
    egress: SlotEgress,
    current_token: str | None,
    cold: bool,
    shares: tuple[Share, ...] = (),
    steps: Steps | None = None,
) -> tuple[VM, Slot, EnvdClient]:
    """Steps 1-2: a VM in the sandbox's directories from `snapshot` (restored, or
    `cold`-booted from its disks alone) on a new slot given `egress`, and the client of its
    envd (holding `current_token`, the token the saved envd has; a booted envd has none). On
    failure nothing of the VM or slot is left; the files are the caller's. The time of each
    step goes into `steps`."""
    steps = steps or Steps()
    workdir, memory_dir = node.dirs(sandbox_id)
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread(memory_dir.mkdir, parents=True, exist_ok=True)
    async with contextlib.AsyncExitStack() as undo:
        slot = await node.slots.acquire(egress=egress.enabled, policy=egress.policy)
        undo.push_async_callback(node.slots.release, slot)
        steps.mark("slot")
        net = NetAttachment(slot.netns, slot.guest.tap, slot.guest.mac)
        place = RestoreSpec(workdir=workdir, net=net, memory_dir=memory_dir, shares=shares)
        if cold:
            vm = await node.driver.boot_saved(snapshot, place)
            undo.push_async_callback(_stop_quietly, vm)
            envd = EnvdClient(node.client, str(slot.address))
            await envd.wait_healthy(BOOT_READY_TIMEOUT)
        else:
            vm = await node.driver.restore(snapshot, place)
            envd = EnvdClient(node.client, str(slot.address), current_token)
        steps.mark("cold boot" if cold else "restore")
        undo.pop_all()
    return vm, slot, envd


async def _stop_quietly(vm: VM) -> None:
    """The undo of a VM start: the slot's release follows, whatever the VMM says."""
    with contextlib.suppress(DriverError):
        await vm.stop()


async def init_envd(node: Node, record: SandboxRecord, envd: EnvdClient) -> None:
    """Step 3: hand envd the sandbox's identity: token, env, hostname, fresh entropy."""
    # What a template build set (ENV, USER, WORKDIR), under the sandbox's own env.
    built = node.templates.by_id(record.template_id)
    envd = await envd.init(
        new_token=record.envd_access_token,
        env_vars={**(built.env_vars if built else {}), **sandbox_env(record)},
        hostname=record.id,
        timeout=RESTORE_READY_TIMEOUT,
        default_user=built.default_user if built else None,
        default_workdir=built.default_workdir if built else None,
        volume_mounts=guest_mounts(record.volume_mounts),
    )
    await trust_egress_ca(node, record, envd)


async def trust_egress_ca(node: Node, record: SandboxRecord, envd: EnvdClient) -> None:
    """A sandbox with header rules trusts the certificates this node's egress proxies show
    for its ruled names. A node without a CA has its proxies refuse those connections."""
    certificate = node.slots.egress_ca
    if record.network.rules.rules and certificate is not None:
        await envd.trust_egress_ca(certificate)


def sandbox_env(record: SandboxRecord) -> dict[str, str]:
    """What every process in the sandbox sees (and envd `/envs` reports), as infra sets it."""
    return {
        **record.env_vars,
        "E2B_SANDBOX": "true",
        "E2B_SANDBOX_ID": record.id,
        "E2B_TEMPLATE_ID": record.template_id,
    }
