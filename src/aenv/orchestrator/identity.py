"""Who a sandbox's workload identity tokens say it is (`network.identity`): its slot's egress
policy given its id, team and template, so that the egress proxy fills in the tokens its header
rules name. The tokens themselves belong to the sandbox's network settings (`iam`), kept
across pause, resume, fork and moves; the subject is each sandbox's own, so a fork's tokens
name the fork."""

from __future__ import annotations

import dataclasses

from aenv.network.identity import Subject, WorkloadIdentity
from aenv.network.settings import SandboxNetwork, SlotEgress
from aenv.orchestrator.catalog import SandboxRecord


def slot_egress(record: SandboxRecord, network: SandboxNetwork | None = None) -> SlotEgress:
    """What the sandbox's slot is given for `network` (its own by default): its header rules
    read its team's secrets, and its workload tokens name its team."""
    network = network or record.network
    egress = network.egress
    policy = dataclasses.replace(egress.policy, team_id=record.team_id)
    if network.iam.tokens:
        subject = Subject(record.id, record.team_id, record.template_id)
        policy = dataclasses.replace(policy, identity=WorkloadIdentity(subject, network.iam))
    return SlotEgress(egress.enabled, policy)
