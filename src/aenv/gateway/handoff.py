"""Moving a paused sandbox to another node when its own is gone or gave it up (a drain).

A call naming a sandbox that has no live node finds, when there is one, its parked record
(`aenv.cluster.parked`): the sandbox is paused and its newest checkpoint is in the cluster's
shared repository. The gateway claims the move (one gateway at a time; the claim lapses if this
one dies), has a placeable node adopt the record (`api.handoff`), routes the sandbox there and
removes the parked record; the call then goes to that node, whose resume pulls the checkpoint.
A gateway that finds the move claimed waits for the route the other one writes.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from aenv.api.errors import APIError
from aenv.api.handoff import ADOPT
from aenv.cluster.directory import Directory
from aenv.cluster.internal import CLUSTER_CALLER
from aenv.cluster.placement import candidates
from aenv.cluster.registry import NodeReport
from aenv.gateway.nodes import NodeClient, NodeFailed, NodeUnreachable

# Longer than an adopt takes (a catalog insert, no VM): past it, another gateway may try.
CLAIM_TTL = 60.0
_POLL = 0.2


class Handoff:
    def __init__(self, directory: Directory, nodes: NodeClient) -> None:
        self.directory = directory
        self.nodes = nodes
        self._me = secrets.token_hex(8)

    async def move(self, sandbox_id: str) -> NodeReport | None:
        """The node the sandbox lives on after moving it there; None when nothing is parked
        under the id (or its publisher still lives: it is not lost). Raises `APIError` when
        no node can take it, `ClusterUnavailable`."""
        parked = await self.directory.parked.get(sandbox_id)
        if parked is None:
            return None
        live = await self.directory.live()
        if parked.node_id and parked.node_id in {n.node_id for n in live}:
            return None
        if not await self.directory.parked.claim(sandbox_id, self._me, CLAIM_TTL):
            return await self._moved_elsewhere(sandbox_id)
        try:
            return await self._adopt(sandbox_id, parked.record, parked.node_id)
        finally:
            await self.directory.parked.unclaim(sandbox_id)

    async def _adopt(self, sandbox_id: str, record: str, old: str) -> NodeReport:
        refusals: list[str] = []
        nodes = [n for n in await self.directory.placeable() if n.node_id != old]
        for node in candidates(nodes, ()):
            try:
                answer = await self.nodes.call(
                    node, "POST", ADOPT, caller=CLUSTER_CALLER, body=record.encode()
                )
            except (NodeUnreachable, NodeFailed) as error:
                refusals.append(str(error))
                continue
            if answer.refusal is not None:
                refusals.append(f"node {node.node_id}: {answer.status} {answer.body[:200]!r}")
                continue
            await self.directory.routes.assign(sandbox_id, node.node_id)
            await self.directory.parked.remove(sandbox_id)
            return node
        why = "; ".join(refusals) or "no live node takes sandboxes"
        raise APIError(503, f"sandbox '{sandbox_id}' lost its node and no other took it: {why}")

    async def _moved_elsewhere(self, sandbox_id: str) -> NodeReport:
        deadline = time.monotonic() + CLAIM_TTL
        while time.monotonic() < deadline:
            node = await self.directory.node_of(sandbox_id)
            if node is not None:
                return node
            await asyncio.sleep(_POLL)
        raise APIError(503, f"sandbox '{sandbox_id}' is moving to another node: try again")
