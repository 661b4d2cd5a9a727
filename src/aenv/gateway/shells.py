"""The dashboard's way to a sandbox's envd on a gateway (its terminal and its files): through
the node that runs the sandbox, on that node's internal data plane.

A gateway has no envd client of its own. What the dashboard's terminal and files pages send to
envd goes to the node's internal API (`aenv.cluster.internal`) with the cluster token and the
sandbox and envd's port named in E2B's headers, as the gateway's data plane forwards an SDK's
envd calls (`dataplane`): the node's own proxy takes it to the guest from there. The sandbox's
envd access token is read from the node (its detail, asked as the operator), so the browser
never holds it. Whether the session's key may see the sandbox is the gateway API's own check,
which the dashboard makes before it asks for the envd here.
"""

from __future__ import annotations

import json
from urllib.parse import quote

from aenv.cluster.directory import Directory, NodeAddress
from aenv.cluster.internal import CLUSTER_CALLER, PREFIX, TOKEN_HEADER
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.store import ClusterUnavailable
from aenv.envd import ENVD_PORT
from aenv.gateway.nodes import NodeClient, NodeFailed, NodeUnreachable
from aenv.orchestrator.envd_client import EnvdClient, http_client
from aenv.proxy.routing import SANDBOX_ID_HEADER, SANDBOX_PORT_HEADER


class NodeShells:
    """`aenv.dashboard.terminal.SandboxShells` over the cluster. Call `aclose()` when the
    gateway stops."""

    def __init__(self, directory: Directory, nodes: NodeClient, secret: ClusterSecret) -> None:
        self.directory = directory
        self.nodes = nodes
        self._bearer = secret.bearer
        # Streams (a download, a shell's output) run as long as they run: no read timeout.
        self._http = http_client()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def envd(self, sandbox_id: str) -> EnvdClient:
        """The sandbox's envd through its node; `LookupError` when no live node runs it."""
        try:
            node = await self.directory.node_of(sandbox_id)
        except ClusterUnavailable as error:
            raise LookupError(sandbox_id) from error
        if node is None:
            raise LookupError(sandbox_id)
        try:
            answer = await self.nodes.call(
                node, "GET", f"/sandboxes/{quote(sandbox_id, safe='')}", caller=CLUSTER_CALLER
            )
        except (NodeUnreachable, NodeFailed) as error:
            raise LookupError(sandbox_id) from error
        if answer.status != 200:
            raise LookupError(sandbox_id)
        detail = json.loads(answer.body)
        if detail.get("state") != "running":
            raise LookupError(sandbox_id)
        address = NodeAddress.of(node.address)
        host = f"[{address.host}]" if ":" in address.host else address.host
        return EnvdClient(
            self._http,
            address.host,
            detail.get("envdAccessToken"),
            via=f"http://{host}:{address.port}{PREFIX}",
            via_headers=(
                (TOKEN_HEADER, self._bearer),
                (SANDBOX_ID_HEADER, sandbox_id),
                (SANDBOX_PORT_HEADER, str(ENVD_PORT)),
            ),
        )
