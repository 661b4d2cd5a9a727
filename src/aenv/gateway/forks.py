"""Forks whose children do not all fit on the parent's node: the rest start on other nodes.

The parent's node forks first: its children start from a local checkpoint, the cheapest way.
When it refuses children for capacity (429 entries, or the whole fork 429), the gateway snapshots
the parent on its node, waits until the snapshot's copy is in the shared repository (its record
published, `aenv.cluster.saved`), and creates the missing children from it with the parent's
metadata, placed as creates are (a node that lacks the snapshot adopts it and pulls it). The
snapshot is deleted afterwards; nodes keep its files while children use them. A child started
this way has the parent's state and metadata, but not its create-time env vars (a snapshot
carries none); its entry is where the refused one was. When the snapshot cannot be taken or
stored, the node's answer stands.

The node's batch fork (`POST /aenv/sandboxes/{id}/fork`, its `children` each with their own
metadata and env vars) spills over alike: a child started elsewhere gets the parent's metadata
with its own entry's over it, and its entry's env vars.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aenv.api.errors import APIError
from aenv.api.limits import wait_of
from aenv.api.models import DEFAULT_TIMEOUT_V2
from aenv.api.scope import team_of
from aenv.cluster.directory import Directory
from aenv.cluster.registry import NodeReport
from aenv.gateway.nodes import Answer, NodeUnreachable
from aenv.gateway.team_quota import TeamQuota

# Longer than a snapshot's upload under load (its memory, disks and images, hashed).
STORED_WAIT = 600.0
_POLL = 0.5


class Control(Protocol):
    """What a fork needs of the control plane."""

    directory: Directory
    team_quota: TeamQuota

    async def node_of(self, sandbox_id: str) -> NodeReport: ...

    async def place(self, request: Request, path: str, body: bytes) -> Answer: ...

    async def call_on(
        self, request: Request, node: NodeReport, method: str, target: str, body: bytes
    ) -> Answer: ...


class Forks:
    def __init__(self, control: Control, stored_wait: float = STORED_WAIT) -> None:
        self.control = control
        self.stored_wait = stored_wait

    async def fork(self, request: Request) -> Response:
        """The fork, one of its team's creates a second (`team_quota`, waited for when its
        client asked to wait)."""
        sandbox_id = request.path_params["sandbox_id"]
        await self.control.team_quota.take_create(team_of(request), wait_of(request))
        node = await self.control.node_of(sandbox_id)
        body = await request.body()
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        answer = await self.control.call_on(request, node, "POST", target, body)
        children = _children(body)
        entries = _entries(answer, len(children))
        short = [i for i, e in enumerate(entries) if e.get("error", {}).get("code") == 429]
        if not short:
            return _respond(answer)
        wanted = [children[i] for i in short]
        spilled = await self._elsewhere(request, node, sandbox_id, wanted, _timeout(body))
        if spilled is None:
            return _respond(answer)
        for index, entry in zip(short, spilled, strict=True):
            entries[index] = entry
        return JSONResponse(entries, status_code=201)

    async def _elsewhere(
        self,
        request: Request,
        node: NodeReport,
        sandbox_id: str,
        children: list[dict[str, Any]],
        timeout: int,
    ) -> list[dict[str, Any]] | None:
        """One child per entry of `children` (its own fields) from a snapshot of the parent,
        placed as creates; None when no snapshot reached the repository, or the parent mounts
        volumes (its children must mount them too, and they live on the parent's node)."""
        info = await self.control.call_on(request, node, "GET", f"/sandboxes/{sandbox_id}", b"")
        parent = json.loads(info.body) if info.status == 200 else {}
        if parent.get("volumeMounts"):
            return None
        taken = await self.control.call_on(
            request, node, "POST", f"/sandboxes/{sandbox_id}/snapshots", b"{}"
        )
        if taken.status != 201:
            return None
        snapshot_id = str(json.loads(taken.body)["snapshotID"])
        try:
            if not await self._stored(snapshot_id):
                return None
            metadata = parent.get("metadata") or {}
            creates = [_create(snapshot_id, timeout, metadata, child) for child in children]
            return [await self._child(request, json.dumps(c).encode()) for c in creates]
        finally:
            await self._drop(request, snapshot_id)

    async def _child(self, request: Request, body: bytes) -> dict[str, Any]:
        try:
            made = await self.control.place(request, "/sandboxes", body)
        except APIError as error:
            return {"error": {"code": error.status, "message": error.message}}
        parsed = json.loads(made.body)
        if made.status != 201:
            return {"error": {"code": made.status, "message": parsed.get("message", "")}}
        return {"sandbox": parsed}

    async def _stored(self, snapshot_id: str) -> bool:
        deadline = time.monotonic() + self.stored_wait
        while await self.control.directory.saved.find(snapshot_id) is None:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(_POLL)
        return True

    async def _drop(self, request: Request, snapshot_id: str) -> None:
        """The snapshot deleted on every live node and withdrawn; a node that cannot be
        reached keeps it until deleted through a gateway."""
        for live in await self.control.directory.live():
            try:
                await self.control.call_on(
                    request, live, "DELETE", f"/templates/{snapshot_id}", b""
                )
            except (NodeUnreachable, APIError):
                continue
        await self.control.directory.saved.withdraw(snapshot_id)


def _create(
    snapshot_id: str, timeout: int, metadata: dict[str, str], child: dict[str, Any]
) -> dict[str, Any]:
    """The create of one child elsewhere: the parent's metadata with the child's own over it,
    and the child's own env vars (a batch fork's entry; E2B's fork has none)."""
    create = {
        "templateID": snapshot_id,
        "timeout": timeout,
        "metadata": {**metadata, **(child.get("metadata") or {})},
    }
    if child.get("envVars"):
        create["envVars"] = child["envVars"]
    return create


def _entries(answer: Answer, count: int) -> list[dict[str, Any]]:
    """The fork's entries: the node's, or one refusal per child when it refused them all."""
    if answer.status == 201:
        parsed = json.loads(answer.body)
        return parsed if isinstance(parsed, list) else []
    if answer.status != 429:
        return []
    refusal = json.loads(answer.body)
    error = {
        "code": 429,
        "message": refusal.get("message", "") if isinstance(refusal, dict) else "",
    }
    return [{"error": error} for _ in range(count)]


def _fields(body: bytes) -> dict[str, Any]:
    """The fork's body as far as the gateway reads it; the node validated it already."""
    try:
        parsed = json.loads(body or b"{}")
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _children(body: bytes) -> list[dict[str, Any]]:
    """Each child's own fields: a batch fork's `children`, or E2B's `count` of none."""
    fields = _fields(body)
    children = fields.get("children")
    if isinstance(children, list):
        return [c if isinstance(c, dict) else {} for c in children]
    count = fields.get("count", 1)
    return [{} for _ in range(count if isinstance(count, int) else 1)]


def _timeout(body: bytes) -> int:
    timeout = _fields(body).get("timeout")
    return timeout if isinstance(timeout, int) else DEFAULT_TIMEOUT_V2


def _respond(answer: Answer) -> Response:
    headers = dict((n.lower(), v) for n, v in answer.headers)
    return Response(answer.body, status_code=answer.status, media_type=headers.get("content-type"))
