"""Volumes through a gateway: each volume lives on the node whose disk holds its files, and
everything about it goes there (`aenv.cluster.volumes` records where).

- `POST /volumes` reserves the name in the caller's team across the cluster, and its size of
  the team's disk (`team_quota`), then is placed
  like a create (a live node that is not draining, by load; one that refuses or cannot be
  reached is skipped); the node that made it is recorded. `GET /volumes` merges every live
  node's volumes.
- `GET`/`DELETE /volumes/{id}` and the content API (`/volumecontent/{id}/...`, which the
  volume's token authorises: the node checks it) go to the volume's node; bodies stream both
  ways. A volume of a node that is gone is a 503 naming the node.
- A create that mounts volumes goes to their node and nowhere else: volumes of different nodes
  are a 400, a draining node a 409, a node without room a 429, a node that is gone a 503, each
  naming the node. Pause and resume keep a sandbox on its node, so it stays with its volumes.
- A volume not recorded (Redis wiped) is looked for on every live node and recorded again.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import quote

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from aenv.api.errors import APIError, not_found
from aenv.api.internal_models import Refusal
from aenv.api.scope import team_of
from aenv.cluster.registry import NodeReport
from aenv.cluster.volumes import VolumePlace
from aenv.gateway.nodes import Answer, NodeCalls, NodeUnreachable, answer_headers, message
from aenv.gateway.saved import passed, target_of
from aenv.gateway.team_quota import VOLUME_HOLD_S, TeamQuota

_CONTENT_METHODS = ["GET", "PUT", "PATCH", "POST", "DELETE"]


class VolumeRoutes:
    def __init__(self, control: NodeCalls, team_quota: TeamQuota) -> None:
        self.control = control
        self.directory = control.directory
        self.team_quota = team_quota

    def routes(self) -> list[Route]:
        return [
            Route("/volumes", self.list_volumes, methods=["GET"]),
            Route("/volumes", self.create_volume, methods=["POST"]),
            Route("/volumes/{volume_id}", self.info, methods=["GET"]),
            Route("/volumes/{volume_id}", self.delete, methods=["DELETE"]),
            Route("/volumecontent/{volume_id}/{rest:path}", self.content, methods=_CONTENT_METHODS),
        ]

    async def list_volumes(self, request: Request) -> Response:
        found: dict[str, dict[str, Any]] = {}
        for answer in await self._everywhere(request, target_of(request)):
            if answer.status != 200:
                return passed(answer)
            for volume in json.loads(answer.body):
                found.setdefault(volume["volumeID"], volume)
        return JSONResponse(sorted(found.values(), key=lambda v: (v["name"], v["volumeID"])))

    async def create_volume(self, request: Request) -> Response:
        body = await request.body()
        name = _field(body, "name")
        team = team_of(request)
        if name and not await self.directory.volumes.reserve(team, name):
            raise APIError(400, f"a volume named '{name}' already exists")
        made = False
        disk = self.team_quota.disk(team, self.team_quota.volume_disk(body), VOLUME_HOLD_S)
        try:
            async with disk:
                node, answer = await self.control.first_taker(
                    request, "/volumes", body, "the volume"
                )
            if answer.status == 201:
                volume = json.loads(answer.body)
                await self.directory.volumes.record(
                    VolumePlace(volume["volumeID"], volume["name"], node.node_id, team)
                )
                made = True
            return passed(answer)
        finally:
            if name and not made:
                await self.directory.volumes.unreserve(team, name)

    async def info(self, request: Request) -> Response:
        place, node = await self._located(request, request.path_params["volume_id"])
        return passed(await self._on(request, place, node, await request.body()))

    async def delete(self, request: Request) -> Response:
        place, node = await self._located(request, request.path_params["volume_id"])
        answer = await self._on(request, place, node, b"")
        if answer.status in (204, 404):
            await self.directory.volumes.forget(place)
        return passed(answer)

    async def content(self, request: Request) -> Response:
        """Streamed both ways; the node checks the volume's token, so none is needed here."""
        ref = request.path_params["volume_id"]
        # No key here: the volume's token names it, by its id (or a default-team name).
        place = await self.directory.volumes.find(ref, None)
        if place is None:
            # As a node answers for a volume it does not have: nothing said about which exist.
            raise APIError(401, "a valid volume token is required: Authorization: Bearer")
        node = await self._node(place)
        try:
            response = await self.control.nodes.open(
                node,
                request.method,
                target_of(request),
                caller=None,
                headers=request.scope["headers"],
                body=request.stream(),
                bearer=True,
            )
        except NodeUnreachable as error:
            raise APIError(503, f"{_lives(place)}, which cannot be reached: {error}") from error
        return StreamingResponse(
            response.aiter_bytes(),
            status_code=response.status_code,
            headers=dict(answer_headers(response)),
            background=BackgroundTask(response.aclose),
        )

    async def create_sandbox(self, request: Request, path: str, body: bytes) -> Answer | None:
        """A create that mounts volumes, on their node; None when it mounts none (or names a
        volume no node has: placed as any create, the node refuses it)."""
        places: list[VolumePlace] = []
        for ref in _mounted(body):
            located = await self._locate(request, ref)
            if located is None:
                return None
            places.append(located)
        if not places:
            return None
        first = places[0]
        if other := next((p for p in places if p.node_id != first.node_id), None):
            raise APIError(
                400,
                f"volumeMounts: volume '{first.name}' lives on node {first.node_id} and "
                f"'{other.name}' on node {other.node_id}: a sandbox mounts volumes of one node",
            )
        node = await self._node(first)
        if first.node_id in await self.directory.drains.draining():
            raise APIError(409, f"{_lives(first)}, which is draining: no new sandboxes there")
        try:
            answer = await self.control.call_on(request, node, "POST", path, body)
        except NodeUnreachable as error:
            raise APIError(503, f"{_lives(first)}, which cannot be reached: {error}") from error
        if answer.refusal is Refusal.FULL:
            raise APIError(429, f"{_lives(first)}, which has no room: {message(answer)}")
        return answer

    async def _located(self, request: Request, ref: str) -> tuple[VolumePlace, NodeReport]:
        place = await self._locate(request, ref)
        if place is None:
            raise not_found(f"volume '{ref}'")
        return place, await self._node(place)

    async def _locate(self, request: Request, ref: str) -> VolumePlace | None:
        """Where the volume (by id or name) lives: from Redis, else from the live nodes' lists
        (then recorded again). Only the caller's team's."""
        team = team_of(request)
        place = await self.directory.volumes.find(ref, team)
        if place is not None:
            return place
        nodes = await self.directory.live()
        answers = await self._everywhere(request, "/volumes", nodes)
        for node, answer in zip(nodes, answers, strict=True):
            if answer.status != 200:
                continue
            for volume in json.loads(answer.body):
                if ref in (volume["volumeID"], volume["name"]):
                    place = VolumePlace(volume["volumeID"], volume["name"], node.node_id, team)
                    await self.directory.volumes.record(place)
                    return place
        return None

    async def _node(self, place: VolumePlace) -> NodeReport:
        node = await self.directory.registry.report(place.node_id)
        if node is None:
            raise APIError(503, f"{_lives(place)}, which is gone")
        return node

    async def _on(
        self, request: Request, place: VolumePlace, node: NodeReport, body: bytes
    ) -> Answer:
        # By its id: a client may name it (the gateway found it by either), its node reads ids.
        target = f"/volumes/{quote(place.volume_id, safe='')}"
        if request.url.query:
            target += f"?{request.url.query}"
        try:
            return await self.control.call_on(request, node, request.method, target, body)
        except NodeUnreachable as error:
            raise APIError(503, f"{_lives(place)}, which cannot be reached: {error}") from error

    async def _everywhere(
        self, request: Request, target: str, nodes: list[NodeReport] | None = None
    ) -> list[Answer]:
        nodes = await self.directory.live() if nodes is None else nodes
        calls = (self.control.call_on(request, n, "GET", target, b"") for n in nodes)
        try:
            return list(await asyncio.gather(*calls))
        except NodeUnreachable as error:
            raise APIError(502, f"listing volumes: {error}") from error


def _lives(place: VolumePlace) -> str:
    return f"volume '{place.name}' lives on node {place.node_id}"


def _field(body: bytes, name: str) -> str:
    try:
        parsed = json.loads(body)
    except ValueError:
        return ""
    value = parsed.get(name) if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else ""


def _mounted(body: bytes) -> list[str]:
    """The volumes a create mounts, for placement only: the node validates the body itself."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return []
    mounts = parsed.get("volumeMounts") if isinstance(parsed, dict) else None
    if not isinstance(mounts, list):
        return []
    return [m["name"] for m in mounts if isinstance(m, dict) and isinstance(m.get("name"), str)]
