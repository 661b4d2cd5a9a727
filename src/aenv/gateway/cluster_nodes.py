"""`GET /nodes` and `POST /nodes/{nodeID}` across a cluster: every live node as E2B's `Node`,
and draining or undraining one.

The list is each live node's own `GET /nodes` answer (its version, machine, CPU and memory now),
asked at once through its internal API, under the cluster's node id and with the cluster's word
on whether it drains (`aenv.cluster.drain`). A node whose answer is not a node list (a node of a
release without the route) is described from its last heartbeat (`Capacity`); one that does not
answer at all is `unhealthy`. Any key may read the list, as on a node.

Draining (`{"status": "draining"}`) marks the node so placement leaves it out, as `aenv node
drain` does, but does not empty it: moving its sandboxes off is the CLI's (`aenv node drain`
pauses them to the shared repository). `{"status": "ready"}` undrains it. Both are the
operator's, so only a key of the default team (`aenv.ids.TEAM_ID`, the one the cluster's first
key and `aenv keys create` make) may change a node's status: another team's key gets a 403.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError, not_found
from aenv.api.requests import check_query, parse_body
from aenv.api.sandboxes import rfc3339
from aenv.cluster.directory import Directory
from aenv.cluster.internal import CLUSTER_CALLER
from aenv.cluster.registry import NodeReport
from aenv.gateway.nodes import NodeClient, NodeFailed, NodeUnreachable
from aenv.ids import TEAM_ID

_MIB = 1 << 20
CLUSTER_ID = "cluster"


class StatusChange(BaseModel):
    """E2B's `NodeStatusChange`: the status to set (its `clusterID` names a cluster of E2B's
    cloud; a gateway serves one, so it is refused rather than ignored)."""

    model_config = ConfigDict(extra="forbid")
    status: Literal["draining", "ready"]


class ClusterNodeRoutes:
    def __init__(self, directory: Directory, nodes: NodeClient) -> None:
        self.directory = directory
        self.nodes = nodes

    def routes(self) -> list[Route]:
        return [
            Route("/nodes", self.list, methods=["GET"]),
            Route("/nodes/{node_id}", self.change, methods=["POST"]),
        ]

    async def list(self, request: Request) -> Response:
        check_query(request)
        live = await self.directory.live()
        draining = await self.directory.drains.draining()
        described = await asyncio.gather(*(self._describe(n, n.node_id in draining) for n in live))
        return JSONResponse(sorted(described, key=lambda n: str(n["id"])))

    async def _describe(self, node: NodeReport, draining: bool) -> dict[str, Any]:
        own = _reported(node)
        try:
            answer = await self.nodes.call(node, "GET", "/nodes", caller=CLUSTER_CALLER)
        except (NodeUnreachable, NodeFailed):
            return {**own, "status": "unhealthy"}
        described = own
        if answer.status == 200:
            try:
                listed = json.loads(answer.body)
            except ValueError:
                listed = None
            if isinstance(listed, list) and listed and isinstance(listed[0], dict):
                described = {**listed[0], "id": node.node_id, "clusterID": CLUSTER_ID}
        if draining:
            described["status"] = "draining"
        return described

    async def change(self, request: Request) -> Response:
        check_query(request)
        key = request.state.api_key
        if key.team_id != TEAM_ID:
            raise APIError(403, "only a key of the default team may drain or undrain a node")
        body = await parse_body(request, StatusChange)
        node_id = request.path_params["node_id"]
        live = {n.node_id for n in await self.directory.live()}
        if node_id not in live and node_id not in await self.directory.drains.draining():
            raise not_found(f"node '{node_id}'")
        if body.status == "draining":
            await self.directory.drains.drain(node_id)
        else:
            await self.directory.drains.undrain(node_id)
        return Response(status_code=204)


def _reported(node: NodeReport) -> dict[str, Any]:
    """The node as its last heartbeat describes it."""
    capacity = node.capacity
    return {
        "id": node.node_id,
        "clusterID": CLUSTER_ID,
        "status": "ready",
        "statusChangedAt": rfc3339(node.reported_at),
        "sandboxCount": capacity.running + capacity.paused,
        "sandboxStartingCount": 0,
        "version": "",
        "commit": "",
        "metrics": {
            "cpuCount": capacity.cpus,
            "cpuPercent": 0,
            "memoryTotalBytes": capacity.memory_mb * _MIB,
            "memoryUsedBytes": (capacity.memory_mb - capacity.memory_free_mb) * _MIB,
        },
    }
