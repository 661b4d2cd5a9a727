"""Templates and snapshots across a cluster's nodes, as one node answers them.

- Snapshots are listed from every live node and from the records of those stored in the shared
  repository (`aenv.cluster.saved`), so a dead node's snapshots are still listed, and a
  snapshot several nodes hold is listed once. Newest first; `sandboxID` and `name` filter,
  `limit` and `nextToken` page the merged list, as on a node.
- Templates are listed from every live node, once each, with the published built templates no
  live node lists (their nodes are gone, their copies are not); a template is read (`GET`,
  `PATCH`, its alias) on the first live node that knows it, and one no live node knows is
  read (`GET`, its alias) from its published record, as it is listed.
- A delete goes to every live node (each drops its copy, the last one the repository's) and
  withdraws the published record; 404 when no node and no record knew it.
- Template builds are placed and routed by `aenv.gateway.builds`, their tags kept on every
  node by `aenv.gateway.tags`; a finished build is published like a snapshot, but only
  snapshots are listed here.
- Teams: the nodes answer for the team the gateway names (`api.internal`); a published record
  is its template's, so it is shown to the template's team (and to all when public), and
  withdrawn by its team only.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote, urlencode

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError, not_found
from aenv.api.extensions import BULK_SNAPSHOTS
from aenv.api.internal_models import Refusal
from aenv.api.requests import check_query
from aenv.api.sandboxes import MAX_PAGE, matching, metadata_filter
from aenv.api.scope import team_of
from aenv.api.templates import alias_body, template_body, with_builds
from aenv.cluster.directory import Directory
from aenv.cluster.registry import NodeReport
from aenv.cluster.saved import SavedRecord
from aenv.gateway.nodes import Answer, NodeUnreachable, message
from aenv.orchestrator.templates import Template, template_from_json

# A call on one node for the client's request: method, path and query, body.
NodeCall = Callable[[Request, NodeReport, str, str, bytes], Awaitable[Answer]]


class SavedRoutes:
    def __init__(self, directory: Directory, call: NodeCall) -> None:
        self.directory = directory
        self.call = call

    def routes(self) -> list[Route]:
        return [
            Route("/snapshots", self.list_snapshots, methods=["GET"]),
            Route("/templates", self.list_templates, methods=["GET"]),
            Route("/v2/templates", self.list_templates, methods=["GET"]),
            Route("/templates/aliases/{alias}", self.alias, methods=["GET"]),
            Route("/templates/{template_id}", self.get, methods=["GET"]),
            Route("/templates/{template_id}", self.first_knowing, methods=["PATCH"]),
            Route("/v2/templates/{template_id}", self.first_knowing, methods=["PATCH"]),
            Route("/templates/{template_id}", self.delete, methods=["DELETE"]),
            Route(BULK_SNAPSHOTS, self.delete_matching, methods=["DELETE"]),
        ]

    async def list_snapshots(self, request: Request) -> Response:
        check_query(request, {"sandboxID", "name", "limit", "nextToken"})
        q = request.query_params
        limit = _limit(q.get("limit"))
        filters = {k: q[k] for k in ("sandboxID", "name") if k in q}
        listed = await asyncio.gather(
            *(self._node_snapshots(request, n, filters) for n in await self.directory.live())
        )
        team = team_of(request)
        records = [
            r
            for r in await self.directory.saved.all()
            if r.kind == "snapshot" and _matches(r, filters) and _owner(r) == team
        ]
        order = {r.template_id: r.created_at for r in records}
        found: dict[str, dict[str, Any]] = {}
        for entries in listed:
            for entry in entries:
                found.setdefault(entry["snapshotID"], entry)
        for record in records:
            found.setdefault(record.template_id, _snapshot(record))
        # Not stored in the repository yet: the newest, so first.
        ids = sorted(found, key=lambda i: (order.get(i, float("inf")), i), reverse=True)
        if token := q.get("nextToken"):
            if token not in ids:
                raise APIError(400, "invalid nextToken")
            ids = ids[ids.index(token) + 1 :]
        page = ids[:limit]
        headers = {"X-Next-Token": page[-1]} if len(ids) > limit else {}
        return JSONResponse([found[i] for i in page], headers=headers)

    async def list_templates(self, request: Request) -> Response:
        check_query(request)
        found: dict[str, dict[str, Any]] = {}
        for answer in await self.everywhere(request, request.url.path):
            if answer.status != 200:
                return passed(answer)
            for entry in json.loads(answer.body):
                found.setdefault(entry["templateID"], entry)
        # Built templates whose nodes are gone are still started from their published copy.
        team = team_of(request)
        for record in await self.directory.saved.all():
            if record.kind == "template" and record.template_id not in found:
                published = template_from_json(record.record)
                if published.visible_to(team):
                    found[record.template_id] = template_body(published)
        return JSONResponse(sorted(found.values(), key=lambda t: t.get("createdAt", "")))

    async def first_knowing(self, request: Request) -> Response:
        """The answer of the first live node that knows the template (not a 404)."""
        return passed(known(await self.first_answer(request)))

    async def get(self, request: Request) -> Response:
        check_query(request, {"limit", "nextToken"})
        ref = unquote(request.path_params["template_id"])
        return await self._known_or_published(
            request, ref, lambda t: with_builds(t, request.query_params)
        )

    async def alias(self, request: Request) -> Response:
        check_query(request)
        ref = unquote(request.path_params["alias"])
        return await self._known_or_published(request, ref, alias_body)

    async def _known_or_published(
        self, request: Request, ref: str, body: Callable[[Template], dict[str, Any]]
    ) -> Response:
        """The first live node's answer that knows the template, else its published record's
        (its nodes are gone, its copy in the repository is not: creates from it still work)."""
        answer = await self.first_answer(request)
        if answer is not None and answer.refusal is not Refusal.NOT_HERE:
            return passed(answer)
        record = await self.directory.saved.find(ref, team_of(request))
        published = None if record is None else template_from_json(record.record)
        if published is None or not published.visible_to(team_of(request)):
            return passed(known(answer))
        return JSONResponse(body(published))

    async def first_answer(self, request: Request) -> Answer | None:
        """The answer of the first live node that knows the template, else the last 404;
        None without a live node."""
        body = await request.body()
        last: Answer | None = None
        for node in await self.directory.live():
            last = await self._on(request, node, target_of(request), body)
            if last.refusal is not Refusal.NOT_HERE:
                return last
        return last

    async def delete(self, request: Request) -> Response:
        ref = request.path_params["template_id"]
        answers = await self.everywhere(request, target_of(request))
        for answer in answers:
            if answer.refusal not in (None, Refusal.NOT_HERE):
                return passed(answer)
        record = await self.directory.saved.find(ref, team_of(request))
        if record is not None and _owner(record) != team_of(request):
            record = None  # another team's: not this caller's to withdraw
        if record is not None:
            await self.directory.saved.withdraw(record.template_id, record.names, record.team_id)
        if record is None and all(a.refusal is Refusal.NOT_HERE for a in answers):
            raise not_found(f"template '{ref}'")
        return Response(status_code=204)

    async def delete_matching(self, request: Request) -> Response:
        """The bulk delete of snapshots by metadata (`api/bulk.py`): every live node deletes
        its own that match, and the published records that match (a gone node's snapshots
        too) are withdrawn, so no node adopts them again."""
        answers = await self.everywhere(request, target_of(request))
        for answer in answers:
            if answer.status != 200:
                return passed(answer)  # a bad filter, refused alike by every node
        ids = {s["snapshotID"] for a in answers for s in json.loads(a.body)["snapshots"]}
        wanted = metadata_filter(request)
        team = team_of(request)
        for record in await self.directory.saved.all():
            published = template_from_json(record.record)
            if published.team_id != team:
                continue
            if record.template_id in ids or matching([published], wanted):
                ids.add(record.template_id)
                await self.directory.saved.withdraw(
                    record.template_id, record.names, record.team_id
                )
        return JSONResponse({"snapshots": [{"snapshotID": i} for i in sorted(ids)]})

    async def _node_snapshots(
        self, request: Request, node: NodeReport, filters: dict[str, str]
    ) -> list[dict[str, Any]]:
        """Every page of the node's snapshots matching `filters`."""
        entries: list[dict[str, Any]] = []
        query = dict(filters)
        while True:
            answer = await self._on(request, node, f"/snapshots?{urlencode(query)}", b"")
            if answer.status != 200:
                raise APIError(answer.status, message(answer))
            entries += json.loads(answer.body)
            token = dict((n.lower(), v) for n, v in answer.headers).get("x-next-token")
            if token is None:
                return entries
            query["nextToken"] = token

    async def everywhere(self, request: Request, target: str) -> list[Answer]:
        """The request's answer from every live node."""
        body = await request.body()
        nodes = await self.directory.live()
        return list(await asyncio.gather(*(self._on(request, n, target, body) for n in nodes)))

    async def _on(self, request: Request, node: NodeReport, target: str, body: bytes) -> Answer:
        try:
            return await self.call(request, node, request.method, target, body)
        except NodeUnreachable as error:
            raise APIError(502, str(error)) from error


def passed(answer: Answer) -> Response:
    return Response(
        answer.body,
        status_code=answer.status,
        media_type=dict((n.lower(), v) for n, v in answer.headers).get("content-type"),
    )


def known(answer: Answer | None) -> Answer:
    """The answer; 503 when there was none, without a live node."""
    if answer is None:
        raise APIError(503, "no live node in the cluster")
    return answer


def target_of(request: Request) -> str:
    return request.url.path + (f"?{request.url.query}" if request.url.query else "")


def _limit(value: str | None) -> int:
    try:
        limit = int(value or MAX_PAGE)
    except ValueError as e:
        raise APIError(400, "limit must be an integer") from e
    if not 1 <= limit <= MAX_PAGE:
        raise APIError(400, f"limit must be between 1 and {MAX_PAGE}")
    return limit


def _matches(record: SavedRecord, filters: dict[str, str]) -> bool:
    if "sandboxID" in filters and record.source_sandbox_id != filters["sandboxID"]:
        return False
    name = filters.get("name", "").split(":", 1)[0]
    return not name or name in (*record.names, record.template_id)


def _owner(record: SavedRecord) -> str:
    """The team of a published template or snapshot."""
    return template_from_json(record.record).team_id


def _snapshot(record: SavedRecord) -> dict[str, Any]:
    return {"snapshotID": record.template_id, "names": list(record.names) or [record.template_id]}
