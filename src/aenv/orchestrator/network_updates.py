"""A sandbox's network settings: checked before a sandbox is made with them, and its egress
rules changed while it exists (`PUT /sandboxes/{id}/network`).

A change of a running sandbox's rules:
1. Check the sandbox can change (running, paused or asleep).
2. Apply the new policy and egress switch to its slot, if it has one; on a refusal the old
   ones are put back and nothing else changes. A running guest given header rules trusts the
   node's egress CA first.
3. Record the new rules in the catalog (a paused sandbox gets them when it resumes).
"""

from __future__ import annotations

import contextlib
import dataclasses
from ipaddress import IPv4Address

from aenv.network import NftError, Slot, socks
from aenv.network.settings import SandboxNetwork, SlotEgress
from aenv.orchestrator.catalog import SandboxRecord
from aenv.orchestrator.errors import InvalidNetwork, InvalidState, OperationFailed
from aenv.orchestrator.events import EventType
from aenv.orchestrator.identity import slot_egress
from aenv.orchestrator.launch import trust_egress_ca
from aenv.orchestrator.node import Node
from aenv.orchestrator.states import ASLEEP, SandboxState


async def check_network(node: Node, network: SandboxNetwork) -> None:
    """Raise `InvalidNetwork` for settings no slot could honour: an egress proxy whose name
    does not resolve, or resolves into a range sandboxes may not reach or to an address of
    the node itself (E2B refuses these before the sandbox exists; the slot's proxy checks
    again at every connection), and a resolver of the sandbox's own in such a range (its
    DNS forwarder would never ask it; only the node's resolver may be private)."""
    denied = node.slots.denied
    if network.rules.rules and node.slots.egress_ca is None:
        raise InvalidNetwork("rules", "this node applies no header rules (it has no egress CA)")
    for server in network.dns_servers or ():
        if any(IPv4Address(server) in n for n in denied):
            message = f"{server} is in a range sandboxes may not reach"
            raise InvalidNetwork("dnsServers", message)
    if network.egress_proxy is not None:
        try:
            await socks.resolve(network.egress_proxy, denied, node.slots.host_netns)
        except socks.TunnelError as e:
            raise InvalidNetwork("egressProxy", str(e)) from e


async def set_egress(node: Node, sandbox_id: str, rules: SandboxNetwork) -> SandboxRecord:
    """Replace the sandbox's egress rules by those of `rules` (its ingress settings stay). A
    running sandbox's slot changes at once, open connections included. Raises
    OperationFailed when the slot refused the change: the old rules then stay, in the slot
    and in the catalog."""
    async with node.lock(sandbox_id):
        record = node.get(sandbox_id)
        if record.state not in (SandboxState.RUNNING, SandboxState.PAUSED, *ASLEEP):
            raise InvalidState(sandbox_id, record.state, "change the network of")
        network = dataclasses.replace(
            record.network,
            allow_internet=rules.allow_internet,
            allow_out=rules.allow_out,
            deny_out=rules.deny_out,
            egress_proxy=rules.egress_proxy,
            dns_servers=rules.dns_servers,
            rules=rules.rules,
        )
        live = node.live.get(sandbox_id)
        if live is not None:
            if network.rules.rules and not record.network.rules.rules:
                ruled = dataclasses.replace(record, network=network)
                await trust_egress_ca(node, ruled, node.envd_of(record))
            await apply_egress(node, live.slot, slot_egress(record), slot_egress(record, network))
        updated = node.catalog.update(sandbox_id, network=network)
        assert updated is not None  # only this task changes a row it holds the lock of
        node.events.record(EventType.UPDATED, updated, {"network_egress": network.redacted_json()})
        return updated


async def apply_egress(node: Node, slot: Slot, old: SlotEgress, new: SlotEgress) -> None:
    """Step 2: `new` on the slot, or `old` back on it and OperationFailed."""
    try:
        await node.slots.set_policy(slot, new.policy)
        await node.slots.set_egress(slot, new.enabled)
    except (NftError, OSError) as e:
        with contextlib.suppress(NftError, OSError):
            await node.slots.set_policy(slot, old.policy)
            await node.slots.set_egress(slot, old.enabled)
        raise OperationFailed(f"could not change the network of slot {slot.netns}: {e}") from e
