"""Reads of a node's sandboxes that change nothing: what users see, where a running guest is
reached, its console output and its envd."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aenv.orchestrator.catalog import SandboxRecord
from aenv.orchestrator.envd_client import EnvdClient
from aenv.orchestrator.errors import SandboxNotFound
from aenv.orchestrator.node import Node
from aenv.orchestrator.states import LIVE


@dataclass(frozen=True)
class GuestEndpoint:
    """Where a running sandbox's guest ports are reached from the host (`host`), which run of
    its VM that is (`incarnation`: it changes on every restore, so connections never outlive a
    VM), and its catalog record."""

    host: str
    incarnation: str
    record: SandboxRecord


def listed(node: Node) -> list[SandboxRecord]:
    """What users see: sandboxes in a public state, the server's own left out."""
    return [r for r in node.catalog.list() if r.state.public is not None and not r.internal]


def guest_endpoint(node: Node, sandbox_id: str) -> GuestEndpoint:
    """A running sandbox's endpoint (one catalog read: the proxy asks on every request)."""
    live = node.live.get(sandbox_id)
    record = node.catalog.get(sandbox_id)
    if live is None or record is None or record.state not in LIVE:
        raise SandboxNotFound(sandbox_id)
    return GuestEndpoint(str(live.slot.address), live.vm.id, record)


def is_paused(node: Node, sandbox_id: str) -> bool:
    record = node.catalog.get(sandbox_id)
    return record is not None and record.state.public == "paused"


def console_logs(node: Node, sandbox_id: str) -> list[Path]:
    """The guest serial console output of every VM this sandbox has run in (one per
    create, resume or restore), oldest first."""
    node.get(sandbox_id)
    workdir, _ = node.dirs(sandbox_id)
    logs = [p for p in workdir.glob("**/console*.log") if p.is_file()]
    return sorted(logs, key=lambda p: p.stat().st_mtime)


def envd(node: Node, sandbox_id: str) -> EnvdClient:
    """The client of a running sandbox's envd (template builds drive their VM with it)."""
    endpoint = guest_endpoint(node, sandbox_id)
    return EnvdClient(node.client, endpoint.host, endpoint.record.envd_access_token)


async def guest_metrics(node: Node, sandbox_id: str) -> dict[str, float]:
    """envd's current resource sample from inside the guest (CPU, memory, disk)."""
    return await envd(node, sandbox_id).metrics()
