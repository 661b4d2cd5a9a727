"""The gateway's data plane: traffic for a sandbox's ports, passed to its node in one hop.

The request is routed as a node routes it (`aenv.proxy.routing`: E2B's headers, the
`{port}-{id}.{domain}` host, `/proxy/...`), looked up in Redis, and forwarded to the node's
internal API with the sandbox named in E2B's headers, so the node's own proxy takes it from there
whichever way the client addressed it. Bodies stream both ways and WebSockets are joined, with the
node proxy's own forwarders: a Connect server stream or an upload is never held whole here.
A request carrying one of the cluster's API keys names it and its team to the node, whose proxy
answers one of another team's as a sandbox that does not exist, as on one node. A sandbox
without a live node that is parked moves to another node first (`handoff`), whose
proxy then resumes it if it asked for auto-resume, as on one node. A node that holds its lease
but does not answer is a 502 naming it (`node_silent`).
"""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from aenv.api.errors import APIError
from aenv.api.keys import KeyBook
from aenv.cluster.directory import Directory, NodeAddress
from aenv.cluster.internal import CALLER_HEADER, PREFIX, TEAM_HEADER, TOKEN_HEADER
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.store import ClusterUnavailable
from aenv.gateway.handoff import Handoff
from aenv.proxy.access import API_KEY_HEADER, check_route
from aenv.proxy.errors import ProxyError, sandbox_not_found
from aenv.proxy.http import HttpForwarder
from aenv.proxy.resolver import Upstream
from aenv.proxy.routing import SANDBOX_ID_HEADER, SANDBOX_PORT_HEADER, Target
from aenv.proxy.websocket import forward_websocket

_REPLACED = frozenset(
    name.lower().encode()
    for name in (SANDBOX_ID_HEADER, SANDBOX_PORT_HEADER, TOKEN_HEADER, CALLER_HEADER, TEAM_HEADER)
)


class DataPlane:
    def __init__(
        self,
        directory: Directory,
        secret: ClusterSecret,
        handoff: Handoff,
        connect_timeout: float = 10.0,
        keys: KeyBook | None = None,
    ) -> None:
        """`keys`: the cluster's, by which a request carrying an API key is named to the node
        with the key's team (none: every request goes on as the cluster's own)."""
        self.directory = directory
        self.keys = keys
        self.handoff = handoff
        self._token = secret.bearer.encode()
        self._connect_timeout = connect_timeout
        self._http = HttpForwarder(connect_timeout=connect_timeout)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def serve(self, target: Target, scope: Scope, receive: Receive, send: Send) -> None:
        """Forwards a request routed to `target`; raises `ProxyError` for the client."""
        check_route(target)
        try:
            caller = await self._caller(scope)
            node = await self.directory.node_of(target.sandbox_id)
            if node is None:
                node = await self.handoff.move(target.sandbox_id)
        except ClusterUnavailable as error:
            raise ProxyError(503, {"code": 503, "message": str(error)}) from error
        except APIError as error:  # parked, and no node took it
            raise ProxyError(
                error.status, {"code": error.status, "message": error.message}
            ) from error
        if node is None:
            raise sandbox_not_found(target.sandbox_id)
        address = NodeAddress.of(node.address)
        # A key the cluster knows goes on as its name and team, not as itself.
        replaced = _REPLACED | ({API_KEY_HEADER} if caller else set())
        headers = [(n, v) for n, v in scope["headers"] if n not in replaced]
        headers += [
            (SANDBOX_ID_HEADER.lower().encode(), target.sandbox_id.encode()),
            (SANDBOX_PORT_HEADER.lower().encode(), str(target.port).encode()),
            (TOKEN_HEADER.lower().encode(), self._token),
            *caller,
        ]
        raw_path = PREFIX.encode() + target.raw_path
        hop = Target(target.sandbox_id, target.port, PREFIX + target.path, raw_path)
        # Pooled connections are per node process: the incarnation is the node's id.
        upstream = Upstream(address.host, address.port, incarnation=node.node_id)
        forwarded = {**scope, "headers": headers}
        try:
            if scope["type"] == "http":
                await self._http.forward(forwarded, receive, send, hop, upstream)
            else:
                await forward_websocket(
                    forwarded, receive, send, hop, upstream, connect_timeout=self._connect_timeout
                )
        except ProxyError as error:
            # The forwarders raise a 502 when the hop failed before an answer: here that is
            # the node, not the sandbox's port, and the node's own answers come as answers.
            if error.status != 502:
                raise
            raise node_silent(target.sandbox_id, node.node_id) from error

    async def _caller(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        """The headers naming the API key the request carries, and its team, to the node, whose
        proxy keeps another team's key from the sandbox (`proxy.access.check_team`); none for
        a request without a key the cluster knows."""
        given = next((v for n, v in scope["headers"] if n == API_KEY_HEADER), None)
        if self.keys is None or not given:
            return []
        key = await self.keys.find(given.decode("latin-1"))
        if key is None:
            return []
        return [
            (CALLER_HEADER.lower().encode(), key.id.encode()),
            (TEAM_HEADER.lower().encode(), key.team_id.encode()),
        ]


def node_silent(sandbox_id: str, node_id: str) -> ProxyError:
    """The sandbox's node holds its lease but does not answer (killed, or cut off). Neither of
    infra's phrases: the SDK raises `SandboxUnreachableException` (state unknown, check with
    `get_info`), not that the sandbox is gone or runs with its port closed."""
    message = (
        f"The sandbox could not be reached: its node {node_id} does not answer (stopped or cut "
        "off). Check its state with Sandbox.get_info()"
    )
    return ProxyError(502, {"sandboxId": sandbox_id, "message": message, "code": 502})
