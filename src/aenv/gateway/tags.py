"""Template tags across a cluster's nodes (E2B's `POST`/`DELETE /templates/tags`,
`GET /templates/{id}/tags`), so that every node holding a template, and every node adopting it
later, knows the tags a client gave it through any gateway.

- A change goes to every live node; each that holds the template changes its own tags (the
  nodes are the truth, and each republishes the template with its tags at its next heartbeat).
  The template's published record (`aenv.cluster.saved`) is changed at once too, so a node that
  adopts it right after takes the tags with it, and a template whose nodes are all gone still
  has its tags changed there. A node's refusal (a bad tag) is the answer; 404 when no live node
  and no record knows the template.
- A list is the first live node's that knows the template, else its published record's (whose
  tags carry no time of their own: the template's is given).
"""

from __future__ import annotations

import dataclasses
import json
from urllib.parse import unquote

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.builds import AssignTagsBody, DeleteTagsBody, check_tags
from aenv.api.errors import APIError, not_found
from aenv.api.internal_models import Refusal
from aenv.api.requests import check_query, parse_body
from aenv.api.sandboxes import rfc3339
from aenv.cluster.saved import SavedRecord
from aenv.gateway.nodes import Answer
from aenv.gateway.saved import SavedRoutes, passed, target_of
from aenv.orchestrator.builds import split_name


class TagRoutes:
    def __init__(self, saved: SavedRoutes) -> None:
        self.saved = saved
        self.records = saved.directory.saved

    def routes(self) -> list[Route]:
        return [
            Route("/templates/tags", self.assign, methods=["POST"]),
            Route("/templates/tags", self.delete, methods=["DELETE"]),
            Route("/templates/{template_id}/tags", self.list, methods=["GET"]),
        ]

    async def assign(self, request: Request) -> Response:
        check_query(request)
        await request.body()  # kept for the nodes: parsing alone would consume the stream
        body = await parse_body(request, AssignTagsBody)
        check_tags(body.tags)
        name, tag = split_name(body.target)
        changed = await self._everywhere(request, name)
        if isinstance(changed, Response):
            return changed
        held, record = changed
        if held is not None:
            build_id = str(json.loads(held.body)["buildID"])
        else:
            build_id = record.tags.get(tag or "latest", record.build_id)
        await self._republish(record, {**record.tags, **dict.fromkeys(body.tags, build_id)})
        if held is not None:
            return passed(held)
        return JSONResponse({"tags": body.tags, "buildID": build_id}, status_code=201)

    async def delete(self, request: Request) -> Response:
        check_query(request)
        await request.body()  # kept for the nodes: parsing alone would consume the stream
        body = await parse_body(request, DeleteTagsBody)
        name, _ = split_name(body.name)
        changed = await self._everywhere(request, name)
        if isinstance(changed, Response):
            return changed
        _, record = changed
        kept = {t: b for t, b in record.tags.items() if t not in body.tags}
        await self._republish(record, kept)
        return Response(status_code=204)

    async def list(self, request: Request) -> Response:
        check_query(request)
        answer = await self.saved.first_answer(request)
        if answer is not None and answer.refusal is not Refusal.NOT_HERE:
            return passed(answer)
        record = await self.records.find(unquote(request.path_params["template_id"]))
        if record is None:
            if answer is None:
                raise APIError(503, "no live node in the cluster")
            return passed(answer)
        created = rfc3339(record.created_at)
        tags = [{"tag": t, "buildID": b, "createdAt": created} for t, b in record.tags.items()]
        return JSONResponse(tags)

    async def _everywhere(
        self, request: Request, name: str
    ) -> tuple[Answer | None, SavedRecord] | Response:
        """The tag change sent to every live node: a holder's answer (None if no live node holds
        the template) and the template's published record; or the client's answer already (a
        node's refusal, or the template has no record)."""
        answers = await self.saved.everywhere(request, target_of(request))
        if (refusal := _refusal(answers)) is not None:
            return passed(refusal)
        held, record = _held(answers), await self.records.find(name)
        if record is None:
            return passed(held) if held is not None else _unknown(answers, name)
        return held, record

    async def _republish(self, record: SavedRecord, tags: dict[str, str]) -> None:
        await self.records.publish(dataclasses.replace(record, tags=tags))


def _refusal(answers: list[Answer]) -> Answer | None:
    """A node's refusal other than not knowing the template (a bad tag, say)."""
    return next((a for a in answers if a.refusal not in (None, Refusal.NOT_HERE)), None)


def _held(answers: list[Answer]) -> Answer | None:
    """The answer of a node that holds the template."""
    return next((a for a in answers if a.refusal is None), None)


def _unknown(answers: list[Answer], name: str) -> Response:
    """No live node and no published record knows the template: a node's 404 says so."""
    if answers:
        return passed(answers[0])
    raise not_found(f"template '{name}'")
