"""The gateway's control plane: E2B's API for a cluster, answered by forwarding to nodes.

- Creates are placed (`aenv.cluster.placement`) and tried node by node: a node that refuses
  (full, draining, failed: `aenv.api.internal_models.Refusal`) or cannot be reached is
  skipped, a refusal by all is a 429 as on one node. A node
  that took the request but whose answer was lost is not retried elsewhere: the sandbox may
  exist there, and a retry could make a second one. A node's not having a template no node is
  known to hold is a refusal too (a build that ended a moment ago on another node is published
  at that node's next heartbeat): only every node's E2B 404 is the answer.
- Calls naming a sandbox go to the live node it is routed to; one that does not answer (killed,
  its lease not lapsed yet) is a 503 whose `Retry-After` is the rest of that lease. One without
  a live node that is parked (paused, its checkpoint in the shared repository) is moved to
  another node first (`handoff`); else E2B's 404, and a route left to a node whose lease is
  gone is removed.
- Creates go to nodes that are not draining; a create mounting volumes goes to their node
  (`volumes`). A create first reserves a slot of its API key's limit of sandboxes at once,
  and one of its team's,
  counted across the cluster (`aenv.cluster.quota`): past it, E2B's 429, or for a create
  that may wait (`X-Aenv-Wait`) a wait for a slot first (`key_slots`). Before that it takes
  one of its team's creates a second, and it holds its team's disk while placed, counted
  across the cluster too (`team_quota`).
- Lists ask every live node and merge (`listing`). Paused sandboxes of lost nodes (and those a
  drain released) are moved to a live node first, so they are listed, paused, as on one node.
- Redis unreachable is a 503 with a JSON error, for as long as it lasts.
- A create from a snapshot another node made has the chosen node adopt its record first
  (`aenv.cluster.saved`): the node pulls its files from the shared repository.
- Templates and snapshots are answered across nodes (`saved`), template builds placed and
  routed to their node (`builds`), tags kept on every node holding the template (`tags`),
  volumes kept on theirs (`volumes`); forks spill over to
  other nodes when the parent's lacks room (`forks`); lifecycle events are merged from every
  live node (`events`), webhooks kept in Redis for every node to deliver (`webhooks`),
  secrets kept there sealed for every node to fill in at egress (`secrets`).
- Every other route of a node is a 501 here for now, naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Collection, Iterable
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError, not_found
from aenv.api.extensions import BATCH_FORK, BULK_SANDBOXES, QUEUE, WAIT_HEADER
from aenv.api.handoff import ADOPT_TEMPLATE
from aenv.api.internal import CURSORS_HEADER, caller_of
from aenv.api.internal_models import Refusal
from aenv.api.limits import wait_of
from aenv.api.queue import client_gone, until_gone
from aenv.api.requests import check_query
from aenv.api.sandboxes import batch_metrics_ids
from aenv.api.scope import team_of
from aenv.api.secrets import SecretRoutes
from aenv.cluster.directory import Directory
from aenv.cluster.internal import CLUSTER_CALLER
from aenv.cluster.placement import candidates
from aenv.cluster.quota import KeyLimitReached, team_owner
from aenv.cluster.registry import NodeReport
from aenv.cluster.saved import SavedRecord
from aenv.cluster.secrets import ClusterSecrets, ConflictingWrites
from aenv.cluster.store import ClusterUnavailable
from aenv.config import Config
from aenv.gateway.builds import BuildRoutes
from aenv.gateway.events import EventRoutes
from aenv.gateway.forks import Forks
from aenv.gateway.handoff import Handoff
from aenv.gateway.key_slots import KeySlots
from aenv.gateway.listing import merge, page_limit
from aenv.gateway.nodes import Answer, NodeClient, NodeFailed, NodeUnreachable, message
from aenv.gateway.saved import SavedRoutes
from aenv.gateway.tags import TagRoutes
from aenv.gateway.team_metrics import TeamMetricRoutes
from aenv.gateway.team_quota import DEFAULT_TEAM_LIMITS, TeamLimitSettings, TeamQuota
from aenv.gateway.volumes import VolumeRoutes
from aenv.gateway.webhooks import WebhookRoutes

# `/sandboxes/{id}...`, `/v2/sandboxes/{id}...` and the node's extensions of one sandbox
# (`/aenv/sandboxes/{id}/...`: reset, batch fork), but not `/sandboxes/metrics`.
_SANDBOX_PATH = re.compile(r"/(?:v2/|aenv/)?sandboxes/(?!metrics(?:/|$))([^/]+)(?:/.*)?")
_SANDBOX_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]

# A create's refusals another node may not have.
_ELSEWHERE = frozenset({Refusal.FULL, Refusal.DRAINING, Refusal.FAILED})
_WAIT = WAIT_HEADER.lower().encode()

log = logging.getLogger("aenv.gateway")


class ControlPlane:
    def __init__(
        self,
        directory: Directory,
        nodes: NodeClient,
        handoff: Handoff,
        key_max_sandboxes: int = Config().key_max_sandboxes,
        team_max_sandboxes: int = Config().team_max_sandboxes,
        team_limits: TeamLimitSettings = DEFAULT_TEAM_LIMITS,
    ) -> None:
        self.directory = directory
        self.nodes = nodes
        self.handoff = handoff
        self.key_max_sandboxes = key_max_sandboxes
        self.key_slots = KeySlots(directory.quota, key_max_sandboxes)
        self.team_slots = KeySlots(directory.quota, team_max_sandboxes, "this team")
        self.team_quota = TeamQuota(directory, team_limits)
        self.volumes = VolumeRoutes(self, self.team_quota)

    def routes(self) -> list[Route]:
        saved = SavedRoutes(self.directory, self.call_on)
        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/sandboxes", self.create, methods=["POST"]),
            Route("/v2/sandboxes", self.create, methods=["POST"]),
            Route("/sandboxes", self.list_v1, methods=["GET"]),
            Route("/v2/sandboxes", self.list_v2, methods=["GET"]),
            Route("/sandboxes/metrics", self.batch_metrics, methods=["GET"]),
            Route("/sandboxes/{sandbox_id}/fork", Forks(self).fork, methods=["POST"]),
            Route(BATCH_FORK, Forks(self).fork, methods=["POST"]),
            Route("/sandboxes/{rest:path}", self.sandbox, methods=_SANDBOX_METHODS),
            Route("/v2/sandboxes/{rest:path}", self.sandbox, methods=_SANDBOX_METHODS),
            Route("/aenv/sandboxes/{rest:path}", self.sandbox, methods=_SANDBOX_METHODS),
            Route(BULK_SANDBOXES + "/{action}", self.bulk, methods=["POST"]),
            Route(QUEUE, self.queue, methods=["GET"]),
            *BuildRoutes(self, saved.first_knowing).routes(),
            # Before the template routes: `/templates/tags` is not a template id.
            *TagRoutes(saved).routes(),
            *saved.routes(),
            *self.volumes.routes(),
            *EventRoutes(self.directory, self.call_on).routes(),
            *TeamMetricRoutes(self.directory, self.call_on).routes(),
            *WebhookRoutes(self.directory, self.call_on).routes(),
            *SecretRoutes(
                ClusterSecrets(
                    self.directory.client, self.directory.secret, self.directory.registry.keys
                )
            ).routes(),
            Route("/{rest:path}", self.not_served, methods=_SANDBOX_METHODS),
        ]

    async def not_served(self, request: Request) -> Response:
        """Routes a node has but a gateway does not serve yet: said plainly, never half done."""
        raise APIError(
            501,
            f"{request.method} {request.url.path} is not served by the cluster gateway yet "
            "(teams): call a node for it",
        )

    async def health(self, _: Request) -> Response:
        """204 while the cluster's Redis answers, as a load balancer's probe needs."""
        await self.directory.live()
        return Response(status_code=204)

    async def create(self, request: Request) -> Response:
        path, body = request.url.path, await request.body()
        wait = wait_of(request)
        async with client_gone(request, wait) as gone:
            creating = self._create(request, path, body, wait)
            return _respond(await until_gone(creating, gone))

    async def _create(self, request: Request, path: str, body: bytes, wait: float) -> Answer:
        """The create, in its team's creates a second, a slot of its key's limit and one of
        its team's (each waited for within `wait`), and its team's disk, which it frees when
        it ends; what is left of `wait` is for a node's room."""
        deadline = time.monotonic() + wait
        team = team_of(request)

        def left() -> float:
            return max(0.0, deadline - time.monotonic()) if wait > 0 else 0.0

        waited = await self.team_quota.take_create(team, wait)
        async with (
            self._slot(self.key_slots, request.state.api_key.id, max(0.0, wait - waited)),
            self._slot(self.team_slots, team_owner(team), left()),
        ):
            ref = _template_of(body)
            need = await self.team_quota.create_disk(request, team, ref, self.call_on) if ref else 0
            async with self.team_quota.disk(team, need):
                answer = await self.volumes.create_sandbox(request, path, body)
                return answer or await self.place(request, path, body, left())

    @contextlib.asynccontextmanager
    async def _slot(self, slots: KeySlots, owner: str, wait: float) -> AsyncIterator[None]:
        """A slot of `owner`'s limit, waited for up to `wait` seconds; a 429 when there is
        none."""
        try:
            token = await slots.reserve(owner, wait)
        except KeyLimitReached as error:
            raise APIError(429, str(error)) from error
        try:
            yield
        finally:
            try:
                await slots.release(owner, token)
            except ClusterUnavailable as error:
                log.warning("reservation %s of %s lapses on its own: %s", token, owner, error)

    def freed(self) -> None:
        """A slot of a key's or team's limit may have freed (a sandbox killed or paused)."""
        self.key_slots.freed()
        self.team_slots.freed()

    async def place(self, request: Request, path: str, body: bytes, wait: float = 0.0) -> Answer:
        """A create (`POST path` with `body`) on the first node that takes it, for the client
        of `request`. Raises `APIError` 429 naming every node's refusal.

        A client that asks to wait `wait` seconds for capacity is first offered every node's
        room now; when none has any, the nodes are asked again with what is left of the wait,
        in placement order, so the first waits in its queue (fair across teams, woken as room
        frees there) and the others, after it, get an immediate try. The gateway has no
        signal of room freeing across nodes short of polling their heartbeats."""
        ref = _template_of(body)
        saved = await self.directory.saved.find(ref, team_of(request)) if ref else None
        holders = await self.directory.file_holders(saved.template_id if saved else ref)
        # A node without the files of a template others hold does not know it yet (a
        # snapshot not in the repository yet): its 404 is a refusal, not the answer.
        try:
            _, answer = await self.first_taker(
                request, path, body, "the sandbox", saved, holders, unheld_refuses=True
            )
        except APIError as refused:
            if refused.status != 429 or wait <= 0:
                raise
            deadline = time.monotonic() + wait
            _, answer = await self.first_taker(
                request, path, body, "the sandbox", saved, holders, True, deadline
            )
        return answer

    async def first_taker(
        self,
        request: Request,
        path: str,
        body: bytes,
        what: str,
        saved: SavedRecord | None = None,
        holders: Collection[str] = (),
        unheld_refuses: bool = False,
        wait_until: float | None = None,
    ) -> tuple[NodeReport, Answer]:
        """`POST path` with `body` on the first placeable node that takes it (`holders` first;
        one lacking `saved` adopts it first), for the client of `request`: the node and its
        answer. A node full, draining or failing (and with `unheld_refuses` a non-holder
        without the template) refuses; `APIError` 429 names every node's refusal, and `what`
        the thing placed. A node may wait for capacity until `wait_until` (`time.monotonic`),
        none without it (the client's `X-Aenv-Wait` is not passed on as it came).

        With `unheld_refuses` and no holder known, a node without the template refuses too:
        it may have been built on another node a moment ago, which publishes it only at its
        next heartbeat. When no node had it, the first one's answer (E2B's 404) is the
        answer."""
        refusals: list[str] = []
        not_found: list[tuple[NodeReport, Answer]] = []
        for node in candidates(await self.directory.placeable(), holders):
            try:
                if saved is not None and node.node_id not in holders:
                    refused = await self.adopt_template(node, saved)
                    if refused is not None:
                        refusals.append(refused)
                        continue
                answer = await self._counted(request, node, path, body, wait_until)
            except NodeUnreachable as error:
                refusals.append(str(error))
                continue
            not_here = answer.refusal is Refusal.NOT_HERE
            unheld = unheld_refuses and not_here and node.node_id not in holders
            if answer.refusal in _ELSEWHERE or unheld:
                refusals.append(f"node {node.node_id}: {answer.status} {message(answer)}")
                if not_here and not holders:
                    not_found.append((node, answer))
                continue
            return node, answer
        if not_found and len(not_found) == len(refusals):
            return not_found[0]
        why = "; ".join(refusals) or "no live node in the cluster"
        raise APIError(429, f"no node can take {what}: {why}")

    async def _counted(
        self,
        request: Request,
        node: NodeReport,
        path: str,
        body: bytes,
        wait_until: float | None,
    ) -> Answer:
        """`POST path` on the node, counted as a create under way there while it lasts, which
        may wait for capacity there until `wait_until`."""
        headers = [(n, v) for n, v in request.scope["headers"] if n.lower() != _WAIT]
        if wait_until is not None:
            left = max(0.0, wait_until - time.monotonic())
            headers.append((_WAIT, f"{left:.3f}".encode()))
        creating = self.directory.creating
        token = await creating.begin(node.node_id)
        try:
            return await self.call_on(request, node, "POST", path, body, headers)
        finally:
            try:
                await creating.end(node.node_id, token)
            except ClusterUnavailable as error:
                log.warning(
                    "create %s on node %s lapses on its own: %s", token, node.node_id, error
                )

    async def adopt_template(self, node: NodeReport, saved: SavedRecord) -> str | None:
        """Has the node record a snapshot it lacks; the refusal, if it refused."""
        try:
            answer = await self.nodes.call(
                node, "POST", ADOPT_TEMPLATE, caller=CLUSTER_CALLER, body=saved.published.encode()
            )
        except NodeFailed as error:
            return str(error)
        if answer.refusal is not None:
            return f"node {node.node_id}: {answer.status} {message(answer)}"
        return None

    async def sandbox(self, request: Request) -> Response:
        match = _SANDBOX_PATH.fullmatch(request.url.path)
        if match is None:
            return await self.not_served(request)
        sandbox_id = match.group(1)
        node = await self.node_of(sandbox_id)
        try:
            answer = await self._call(request, node, await request.body())
        except NodeUnreachable as error:
            raise await self._node_silent(sandbox_id, node) from error
        if answer.status < 300 and _frees_slot(request):
            self.freed()
        return _respond(answer)

    async def _node_silent(self, sandbox_id: str, node: NodeReport) -> APIError:
        """The answer while a sandbox's node holds its lease but does not answer (killed, or
        cut off): a 503 to retry once the lease has lapsed, when the sandbox is either on its
        node again or answered as E2B's 404. The Python SDK waits `Retry-After` itself, so
        `get_info` ends in `SandboxNotFoundException` and `kill` in False for a dead node."""
        left = await self.directory.registry.lease_left(node.node_id)
        wait = max(1, math.ceil(left or 0))
        return APIError(
            503,
            f"sandbox '{sandbox_id}' is on node {node.node_id}, which does not answer "
            f"(stopped or cut off): try again in {wait} s, when the node is back or its "
            "lease has lapsed",
            retry_after=wait,
        )

    async def batch_metrics(self, request: Request) -> Response:
        """E2B's `/sandboxes/metrics`: each named sandbox's node asked for its own, merged. One
        on no live node (or an unreachable one) is left out, as a node leaves out what is not
        running."""
        ids = batch_metrics_ids(request)
        nodes = await asyncio.gather(*(self.directory.node_of(i) for i in ids))
        by_node: dict[str, tuple[NodeReport, list[str]]] = {}
        for sandbox_id, node in zip(ids, nodes, strict=True):
            if node is not None:
                by_node.setdefault(node.node_id, (node, []))[1].append(sandbox_id)
        found = await asyncio.gather(
            *(self._node_metrics(request, node, its) for node, its in by_node.values())
        )
        return JSONResponse({"sandboxes": {k: v for f in found for k, v in f.items()}})

    async def _node_metrics(
        self, request: Request, node: NodeReport, sandbox_ids: list[str]
    ) -> dict[str, Any]:
        target = "/sandboxes/metrics?" + urlencode({"sandbox_ids": ",".join(sandbox_ids)})
        try:
            answer = await self.call_on(request, node, "GET", target, b"")
        except (NodeUnreachable, APIError) as error:
            log.warning("metrics of node %s left out: %s", node.node_id, error)
            return {}
        if answer.status != 200:
            log.warning("metrics of node %s left out: %d", node.node_id, answer.status)
            return {}
        sandboxes: dict[str, Any] = json.loads(answer.body)["sandboxes"]
        return sandboxes

    async def node_of(self, sandbox_id: str) -> NodeReport:
        """The live node of the sandbox, moved to one first if its own is gone; else 404."""
        node = await self.directory.node_of(sandbox_id)
        if node is None:
            node = await self.handoff.move(sandbox_id)
        if node is None:
            # Not parked either: a route left to a dead node goes, the sandbox went with it.
            await self.directory.unroute_lost(sandbox_id)
            raise not_found(f"sandbox '{sandbox_id}'")
        return node

    async def list_v1(self, request: Request) -> Response:
        await self.move_lost()
        answers = await self._ask_all(request)
        merged = [s for a in answers for s in json.loads(a.body)]
        merged.sort(key=lambda s: (s["startedAt"], s["sandboxID"]))
        return JSONResponse(merged)

    async def list_v2(self, request: Request) -> Response:
        await self.move_lost()
        answers = await self._ask_all(request)
        q = request.query_params
        ascending = q.get("order", "desc").lower() == "asc"
        page = merge(answers, page_limit(q.get("limit")), ascending)
        headers = {} if page.next_token is None else {"X-Next-Token": page.next_token}
        return JSONResponse(page.sandboxes, headers=headers)

    async def bulk(self, request: Request) -> Response:
        """The bulk operations on sandboxes by metadata (`api/bulk.py`): every live node runs
        it on its own sandboxes (a lost node's paused ones moved to a live one first), and
        their entries are merged."""
        body = await request.body()
        await self.move_lost()
        answers = await self._ask_all(request, body)
        merged = [e for a in answers for e in json.loads(a.body)["sandboxes"]]
        self.freed()
        return JSONResponse({"sandboxes": merged})

    async def queue(self, request: Request) -> Response:
        """`GET /aenv/queue` across the cluster: every live node's waiters summed, the
        caller's key's places in each node's queue (1 is next there), per node under
        `nodes`, the key's creates waiting at this gateway for a slot of its limit, and its
        team's (any key's) waiting for a slot of the team's."""
        check_query(request)
        nodes = await self.directory.live()
        calls = [self._call(request, node, b"") for node in nodes]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        per_node: dict[str, Any] = {}
        for node, answer in zip(nodes, answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, NodeUnreachable):
                    raise answer
            elif answer.status != 200:
                raise _Passed(answer)
            else:
                per_node[node.node_id] = json.loads(answer.body)
        keys, teams = self.key_slots.waiting, self.team_slots.waiting
        team = team_owner(team_of(request))
        return JSONResponse(
            {
                "waiting": sum(q["waiting"] for q in per_node.values()) + len(keys) + len(teams),
                "positions": sorted(p for q in per_node.values() for p in q["positions"]),
                "maxWait": min((q["maxWait"] for q in per_node.values()), default=0),
                "keyLimitWaiting": len(keys.positions(request.state.api_key.id)),
                "teamLimitWaiting": len(teams.positions(team)),
                "nodes": per_node,
            }
        )

    async def move_lost(self) -> None:
        """Moves every parked sandbox whose node is gone onto a live one (a record insert there,
        no VM). One no node takes is left parked and not listed; a connect to it says why."""
        live = {n.node_id for n in await self.directory.live()}
        lost = sorted(await self.directory.parked.lost(live))
        moves = await asyncio.gather(*(self.handoff.move(i) for i in lost), return_exceptions=True)
        for sandbox_id, moved in zip(lost, moves, strict=True):
            if isinstance(moved, ClusterUnavailable):
                raise moved
            if isinstance(moved, BaseException):
                log.warning("paused sandbox %s of a lost node not moved: %s", sandbox_id, moved)

    async def _ask_all(self, request: Request, body: bytes = b"") -> list[Answer]:
        """Every live node's answer to the request; the first refusal is the client's answer
        (a bad filter is refused alike by all)."""
        nodes = await self.directory.live()
        calls = [self._call(request, node, body) for node in nodes]
        try:
            answers = await asyncio.gather(*calls)
        except NodeUnreachable as error:
            raise APIError(502, f"{request.url.path} on every node: {error}") from error
        for answer in answers:
            if answer.status != 200:
                raise _Passed(answer)
        return answers

    async def _call(self, request: Request, node: NodeReport, body: bytes) -> Answer:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return await self.call_on(request, node, request.method, target, body)

    async def call_on(
        self,
        request: Request,
        node: NodeReport,
        method: str,
        target: str,
        body: bytes,
        headers: Iterable[tuple[bytes, bytes]] | None = None,
    ) -> Answer:
        """`method target` on the node, for the client's request (its key, its headers unless
        `headers` are given)."""
        try:
            return await self.nodes.call(
                node,
                method,
                target,
                caller=caller_of(request.state.api_key),
                headers=request.scope["headers"] if headers is None else headers,
                body=body,
            )
        except NodeFailed as error:
            raise APIError(502, str(error), should_retry=False) from error


class _Passed(Exception):
    """A node's answer that is the client's answer as is."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(answer.status)
        self.answer = answer


async def passed(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, _Passed)
    return _respond(exc.answer)


async def unavailable(_: Request, exc: Exception) -> Response:
    return APIError(503, f"the cluster is unavailable: {exc}").response()


async def conflicting(_: Request, exc: Exception) -> Response:
    return APIError(409, str(exc)).response()


EXCEPTION_HANDLERS = {
    _Passed: passed,
    ClusterUnavailable: unavailable,
    ConflictingWrites: conflicting,
}


def _respond(answer: Answer) -> Response:
    response = Response(answer.body, status_code=answer.status)
    for name, value in answer.headers:
        if name.lower() != CURSORS_HEADER.lower():
            response.headers.append(name, value)
    return response


def _frees_slot(request: Request) -> bool:
    """Whether the sandbox call, done, leaves its key's limit a slot: a kill or a pause."""
    return request.method == "DELETE" or (
        request.method == "POST" and request.url.path.endswith("/pause")
    )


def _template_of(body: bytes) -> str:
    """The template a create names, for placement only: the node validates the body itself."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return ""
    value = parsed.get("templateID") if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else ""
