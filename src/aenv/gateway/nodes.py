"""Control-plane calls from a gateway to nodes' internal API: one request, answered whole.

Control-plane answers are small JSON documents, so they are read whole: a create can then be
retried on another node when one refuses, and lists can be merged. Data-plane traffic streams
instead (`dataplane`).

A call is made in the highest internal version both sides speak (`aenv.api.internal_models`;
the node names its versions in its report). In version 1 the E2B request the gateway serves is
sent as the typed call of its operation, and the node says in its answer whether and why it
refused; what version 1 does not carry, and every call to a node of the previous release
(version 0 only), is the client's request replayed, whose refusal is read from its status
(`_replayed_refusal`, to go with version 0).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterable, Collection, Iterable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import parse_qs, quote

import httpx
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from aenv.api.extensions import WAIT_HEADER
from aenv.api.idempotency import HEADER as IDEMPOTENCY_HEADER
from aenv.api.internal_models import (
    ADOPT_ROUTES,
    CREATE_ROUTES,
    FAMILIES,
    INTERNAL_VERSIONS,
    METRICS_ROUTE,
    PREFIX_V1,
    REPLAY,
    SINGLES,
    Adopt,
    CreateSandbox,
    E2BCall,
    Metrics,
    NodeAnswer,
    Refusal,
)
from aenv.cluster.directory import Directory, NodeAddress
from aenv.cluster.internal import CALLER_HEADER, PREFIX, TEAM_HEADER, TOKEN_HEADER
from aenv.cluster.registry import NodeReport
from aenv.cluster.saved import SavedRecord
from aenv.cluster.secret import ClusterSecret
from aenv.proxy.headers import end_to_end

# What a client sends that must not reach the node: its credentials for the gateway (the node
# trusts the cluster token instead), and any cluster headers it tried to forge.
_DROPPED = frozenset(
    {b"host", b"x-api-key", b"authorization", b"content-length", b"x-aenv-cluster-token",
     b"x-aenv-caller", b"x-aenv-caller-team"}
)  # fmt: skip
# What a node's answer carries that the gateway's server sets again.
_RESPONSE_DROPPED = frozenset({"content-length", "content-encoding", "date", "server"})
_IDEMPOTENCY = IDEMPOTENCY_HEADER.lower().encode()
_WAIT = WAIT_HEADER.lower().encode()
# A version 1 call's own refusals (no such route, a malformed call), made before it ran.
_NOT_IN_ITS_V1 = frozenset({400, 404})


@dataclass(frozen=True)
class _Operation:
    """A version 1 call as the E2B route a gateway recognises it by."""

    path: str  # under `PREFIX_V1`, with the route's parts and `{op}`
    op: str
    method: str
    pattern: re.Pattern[str]  # the route's path, capturing its `{...}` parts by name
    call: type[E2BCall]


def _pattern(path: str) -> re.Pattern[str]:
    return re.compile(re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(path)))


# Each E2B route a version 1 call carries, in the order they are matched.
_OPERATIONS = [
    *(
        _Operation(family.path, op.value, method, _pattern(path), family.call)
        for family in FAMILIES
        for op, (method, path) in (*family.routes.items(), *family.aliases)
    ),
    *(_Operation(c.path, "", c.route[0], _pattern(c.route[1]), c.call) for c in SINGLES),
]


class NodeUnreachable(Exception):
    """The node did not take the request: nothing happened there, another node may be tried."""


class NodeFailed(Exception):
    """The request reached the node but its answer did not come back: it may have happened."""


@dataclass(frozen=True)
class Answer:
    """A node's E2B answer, and why it did not do what it was asked (None: it did)."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes
    refusal: Refusal | None = None


class NodeClient:
    def __init__(self, secret: ClusterSecret, timeout: float = 600.0) -> None:
        self._secret = secret
        # Creates under TCG load take minutes at worst; connecting must be quick. Nodes are
        # reached directly, never through the host's proxy settings, which would see the
        # cluster secret.
        self._http = httpx.AsyncClient(
            trust_env=False,
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
        given as chunks streams to the node (an upload), the answer is read whole. In version 1
        when both sides speak it and it carries the call, else replayed."""
        headers = list(headers)
        typed = _typed(method, target, body, headers) if speaks(node) > REPLAY else None
        if typed is not None:
            answer = await self._call_v1(node, *typed, caller=caller)
            if answer is not None:
                return answer
        response = await self.open(node, method, target, caller=caller, headers=headers, body=body)
        content = await _read(node, response)
        status = response.status_code
        return Answer(status, answer_headers(response), content, _replayed_refusal(status))

    async def _call_v1(
        self, node: NodeReport, path: str, call: BaseModel, *, caller: str
    ) -> Answer | None:
        """The call in version 1; None when the node's version 1 lacks it (a node of an earlier
        build of this release, whose version 1 had fewer calls or fields: it did nothing, and
        the call is replayed). Fields left at their defaults are not sent, so a call using no
        new field reaches such a node in version 1 too."""
        body = call.model_dump_json(exclude_defaults=True).encode()
        response = await self.open(
            node, "POST", PREFIX_V1 + path, caller=caller, body=body, typed=True
        )
        content = await _read(node, response)
        if response.status_code in _NOT_IN_ITS_V1:
            return None
        if response.status_code != 200:
            # Refused by the internal API itself (a wrong token): nothing was done.
            return Answer(response.status_code, answer_headers(response), content, Refusal.FAILED)
        try:
            answer = NodeAnswer.model_validate_json(content)
        except ValidationError as error:
            raise NodeFailed(f"node {node.node_id} answered no NodeAnswer: {error}") from error
        return Answer(answer.status, answer.headers, answer.body.encode(), answer.refusal)

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
        typed: bool = False,
    ) -> httpx.Response:
        """As `call`, replayed, with the answer's body left to stream (the caller closes it).
        With `bearer` the client's `Authorization` goes through (a volume's token, which the
        node checks), and without a `caller` the node sees no API key (routes open without
        one). A `typed` call is a version 1 call's JSON."""
        address = NodeAddress.of(node.address)
        dropped = _DROPPED - {b"authorization"} if bearer else _DROPPED
        sent = [
            (n.decode("latin-1"), v.decode("latin-1"))
            for n, v in end_to_end(list(headers))
            if n not in dropped
        ]
        if typed:
            sent.append(("content-type", "application/json"))
        sent.append((TOKEN_HEADER, self._secret.bearer))
        if caller is not None:
            # The team apart: a node from before teams reads the key id alone, as it did.
            key_id, _, team = caller.partition(" ")
            sent.append((CALLER_HEADER, key_id))
            if team:
                sent.append((TEAM_HEADER, team))
        url = f"http://{address.host}:{address.port}{PREFIX}{target}"
        request = self._http.build_request(method, url, headers=sent, content=body)
        try:
            return await self._http.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            raise NodeUnreachable(f"node {node.node_id} at {node.address}: {error!r}") from error
        except httpx.HTTPError as error:
            raise NodeFailed(f"node {node.node_id} at {node.address}: {error!r}") from error


def speaks(node: NodeReport) -> int:
    """The highest internal version the node and this gateway both speak. Raises
    `NodeUnreachable` (nothing was sent) when they share none."""
    common = set(node.internal_versions) & set(INTERNAL_VERSIONS)
    if not common:
        raise NodeUnreachable(
            f"node {node.node_id} speaks internal API versions "
            f"{sorted(node.internal_versions)}, this gateway {list(INTERNAL_VERSIONS)}: "
            "upgrade the older one"
        )
    return max(common)


def _typed(
    method: str,
    target: str,
    body: bytes | AsyncIterable[bytes],
    headers: list[tuple[bytes, bytes]],
) -> tuple[str, BaseModel] | None:
    """The version 1 call (its path under `PREFIX_V1`, its JSON) of an E2B request; None when
    version 1 does not carry it (a streamed or non-UTF-8 body, a query or body its call has no
    field for, another route)."""
    path, _, query = target.partition("?")
    if not isinstance(body, bytes):
        return None
    try:
        text = body.decode()
    except UnicodeDecodeError:
        return None
    if method == "POST" and not query and (created := _create(path, text, headers)) is not None:
        return created
    if (method, path) == ("GET", METRICS_ROUTE):
        return None if text else _metrics(query)
    for operation in _OPERATIONS:
        match = operation.pattern.fullmatch(path)
        if match is None or method != operation.method:
            continue
        call = operation.call.carrying(query, text)
        if call is None:
            return None
        parts = {name: quote(value, safe="") for name, value in match.groupdict().items()}
        return operation.path.format(op=operation.op, **parts), call
    return None


def _metrics(query: str) -> tuple[str, BaseModel] | None:
    """The version 1 call of a batch metrics request; None for a query it cannot carry (a
    parameter repeated or unknown: the node's 400 for it comes from its replay)."""
    parsed = parse_qs(query, keep_blank_values=True)
    if set(parsed) != {"sandbox_ids"} or len(parsed["sandbox_ids"]) != 1:
        return None
    ids = [i for i in parsed["sandbox_ids"][0].split(",") if i]
    return "/metrics", Metrics(sandbox_ids=ids)


def _create(
    path: str, text: str, headers: list[tuple[bytes, bytes]]
) -> tuple[str, BaseModel] | None:
    """The version 1 call of a `POST path` that creates or adopts something, if it is one."""
    for api, create in CREATE_ROUTES.items():
        if path == create:
            key = next((v for n, v in headers if n.lower() == _IDEMPOTENCY), None)
            wait = next((v for n, v in headers if n.lower() == _WAIT), None)
            return "/sandboxes", CreateSandbox(
                api=api,
                body=text,
                idempotency_key=None if key is None else key.decode("latin-1"),
                wait=None if wait is None else wait.decode("latin-1"),
            )
    for kind, adopt in ADOPT_ROUTES.items():
        if path == adopt:
            return f"/adopt/{kind.value}", Adopt(record=text)
    return None


def _replayed_refusal(status: int) -> Refusal | None:
    """A replayed answer's refusal, read from its status as version 0 has it."""
    if status < 400:
        return None
    if status == 429:
        return Refusal.FULL
    if status == 404:
        return Refusal.NOT_HERE
    return Refusal.FAILED if status >= 500 else Refusal.REJECTED


async def _read(node: NodeReport, response: httpx.Response) -> bytes:
    try:
        return await response.aread()
    except httpx.HTTPError as error:
        raise NodeFailed(f"node {node.node_id} at {node.address}: {error!r}") from error
    finally:
        await response.aclose()


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
