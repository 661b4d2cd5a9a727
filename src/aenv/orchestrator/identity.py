"""Who a sandbox's workload identity tokens say it is (`network.identity`): its slot's egress
policy given its id, team and template, so that the egress proxy fills in the tokens its header
rules name. The tokens themselves belong to the sandbox's network settings (`iam`), kept
across pause, resume, fork and moves; the subject is each sandbox's own, so a fork's tokens
name the fork."""

from __future__ import annotations

import dataclasses

from aenv.ids import TEAM_ID
from aenv.network.identity import Subject, WorkloadIdentity
from aenv.network.settings import SandboxNetwork, SlotEgress
from aenv.orchestrator.catalog import SandboxRecord


def slot_egress(record: SandboxRecord, network: SandboxNetwork | None = None) -> SlotEgress:
    """What the sandbox's slot is given for `network` (its own by default)."""
    network = network or record.network
    egress = network.egress
    if not network.iam.tokens:
        return egress
    subject = Subject(record.id, TEAM_ID, record.template_id)
    identity = WorkloadIdentity(subject, network.iam)
    return SlotEgress(egress.enabled, dataclasses.replace(egress.policy, identity=identity))
