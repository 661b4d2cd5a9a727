"""Emptying a node that drains: each of its sandboxes is released (paused if it ran, its
checkpoint in the shared repository, forgotten by the node) and parked, so that the next call
naming it moves it to another node (`handoff`). One at a time: a pause under load is heavy."""

from __future__ import annotations

from dataclasses import dataclass

from aenv.api.handoff import RELEASE
from aenv.cluster.directory import Directory
from aenv.cluster.internal import CLUSTER_CALLER
from aenv.gateway.nodes import NodeClient, NodeFailed, NodeUnreachable


@dataclass(frozen=True)
class Released:
    sandbox_id: str
    error: str | None  # None: parked for another node


async def evacuate(directory: Directory, nodes: NodeClient, node_id: str) -> list[Released]:
    """Releases every sandbox routed to `node_id`; raises `LookupError` when it is not live."""
    node = await directory.registry.report(node_id)
    if node is None:
        raise LookupError(f"node {node_id} is not live")
    done: list[Released] = []
    for sandbox_id in sorted(await directory.routes.of_node(node_id)):
        path = RELEASE.format(sandbox_id=sandbox_id)
        try:
            answer = await nodes.call(node, "POST", path, caller=CLUSTER_CALLER)
        except (NodeUnreachable, NodeFailed) as error:
            done.append(Released(sandbox_id, str(error)))
            continue
        if answer.refusal is not None:
            done.append(Released(sandbox_id, f"{answer.status} {answer.body[:300]!r}"))
            continue
        await directory.parked.released(sandbox_id, answer.body.decode())
        done.append(Released(sandbox_id, None))
    return done
