"""Control-plane calls from a gateway to nodes' internal API: one request, answered whole.

Control-plane answers are small JSON documents, so they are read whole: a create can then be
retried on another node when one refuses, and lists can be merged. Data-plane traffic streams
instead (`dataplane`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

import httpx
from starlette.requests import Request

from aenv.cluster.directory import Directory, NodeAddress
from aenv.cluster.internal import CALLER_HEADER, PREFIX, TOKEN_HEADER
from aenv.cluster.registry import NodeReport
from aenv.cluster.saved import SavedRecord
from aenv.cluster.secret import ClusterSecret
from aenv.proxy.headers import end_to_end

# What a client sends that must not reach the node: its credentials for the gateway (the node
# trusts the cluster token instead), and any cluster headers it tried to forge.
_DROPPED = frozenset(
    {b"host", b"x-api-key", b"authorization", b"content-length", b"x-aenv-cluster-token",
     b"x-aenv-caller"}
)  # fmt: skip
# What a node's answer carries that the gateway's server sets again.
_RESPONSE_DROPPED = frozenset({"content-length", "content-encoding", "date", "server"})


class NodeUnreachable(Exception):
    """The node did not take the request: nothing happened there, another node may be tried."""


class NodeFailed(Exception):
    """The request reached the node but its answer did not come back: it may have happened."""


@dataclass(frozen=True)
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


class NodeClient:
    def __init__(self, secret: ClusterSecret, timeout: float = 600.0) -> None:
        self._secret = secret
        # Creates under TCG load take minutes at worst; connecting must be quick.
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def call(
        self,
        node: NodeReport,
        method: str,
        target: str,
        *,
        caller: str,
        headers: Iterable[tuple[bytes, bytes]] = (),
        body: bytes | AsyncIterable[bytes] = b"",
    ) -> Answer:
        """`method target` (path and query) on `node`, for the API key id `caller`; a `body`
        given as chunks streams to the node (an upload), the answer is read whole."""
        response = await self.open(node, method, target, caller=caller, headers=headers, body=body)
        try:
            content = await response.aread()
        except httpx.HTTPError as error:
            raise NodeFailed(f"node {node.node_id} at {node.address}: {error!r}") from error
        finally:
            await response.aclose()
        return Answer(response.status_code, answer_headers(response), content)

    async def open(
        self,
        node: NodeReport,
        method: str,
        target: str,
        *,
        caller: str | None,
        headers: Iterable[tuple[bytes, bytes]] = (),
        body: bytes | AsyncIterable[bytes] = b"",
        bearer: bool = False,
    ) -> httpx.Response:
        """As `call`, with the answer's body left to stream (the caller closes it). With
        `bearer` the client's `Authorization` goes through (a volume's token, which the node
        checks), and without a `caller` the node sees no API key (routes open without one)."""
        address = NodeAddress.of(node.address)
        dropped = _DROPPED - {b"authorization"} if bearer else _DROPPED
        sent = [
            (n.decode("latin-1"), v.decode("latin-1"))
            for n, v in end_to_end(list(headers))
            if n not in dropped
        ]
        sent.append((TOKEN_HEADER, self._secret.bearer))
        if caller is not None:
            sent.append((CALLER_HEADER, caller))
        url = f"http://{address.host}:{address.port}{PREFIX}{target}"
        request = self._http.build_request(method, url, headers=sent, content=body)
        try:
            return await self._http.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            raise NodeUnreachable(f"node {node.node_id} at {node.address}: {error!r}") from error
        except httpx.HTTPError as error:
            raise NodeFailed(f"node {node.node_id} at {node.address}: {error!r}") from error


def answer_headers(response: httpx.Response) -> list[tuple[str, str]]:
    """A node's answer headers the client gets (not those the gateway's server sets)."""
    return [(n, v) for n, v in response.headers.multi_items() if n not in _RESPONSE_DROPPED]


def message(answer: Answer) -> str:
    """The `message` of a node's JSON error, else the start of its body."""
    try:
        parsed = json.loads(answer.body)
    except ValueError:
        return answer.body[:200].decode(errors="replace")
    return str(parsed.get("message", "")) if isinstance(parsed, dict) else ""


class NodeCalls(Protocol):
    """What routes placing calls on nodes (builds, volumes) need of the control plane
    (`aenv.gateway.control.ControlPlane`)."""

    directory: Directory
    nodes: NodeClient

    async def call_on(
        self, request: Request, node: NodeReport, method: str, target: str, body: bytes
    ) -> Answer: ...

    async def first_taker(
        self,
        request: Request,
        path: str,
        body: bytes,
        what: str,
        saved: SavedRecord | None = None,
        holders: Collection[str] = (),
        unheld_refuses: bool = False,
    ) -> tuple[NodeReport, Answer]: ...
