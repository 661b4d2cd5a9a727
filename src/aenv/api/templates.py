"""Template routes of the E2B control plane: list, get with its builds, alias lookup, update,
delete."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError, not_found
from aenv.api.requests import check_query, parse_body
from aenv.api.sandboxes import MAX_PAGE, rfc3339
from aenv.api.scope import team_of
from aenv.orchestrator.build_records import Build, BuildStatus
from aenv.orchestrator.builds import Builder
from aenv.orchestrator.lifecycle import Orchestrator
from aenv.orchestrator.templates import Template, TemplateNotFound

_WITH_BUILDS = (
    "templateID",
    "public",
    "aliases",
    "names",
    "createdAt",
    "updatedAt",
    "lastSpawnedAt",
    "spawnCount",
)


def template_body(t: Template, latest: Build | None = None) -> dict[str, Any]:
    """A template as `GET /templates` lists it (also a gateway, for published ones): its
    files are those of its last ready build; `buildStatus` is its newest build's, as in E2B
    (a rebuild running or failed shows)."""
    return {
        "templateID": t.template_id,
        "buildID": t.build_id,
        "cpuCount": t.cpu_count,
        "memoryMB": t.memory_mb,
        "diskSizeMB": t.disk_size_mb,
        "public": t.is_public,
        "aliases": list(t.aliases),
        "names": list(t.aliases) or [t.template_id],
        "createdAt": rfc3339(t.created_at),
        "updatedAt": rfc3339(t.created_at),
        "createdBy": None,
        "lastSpawnedAt": None,
        "spawnCount": 0,
        "buildCount": 1,
        "envdVersion": t.envd_version,
        "buildStatus": "ready" if latest is None else str(latest.status),
    }


def unbuilt_body(build: Build) -> dict[str, Any]:
    """A template whose first build is waiting, running or failed: listed with that build's
    state, so that it does not stay invisible until it is ready (no sandbox starts from it)."""
    created = rfc3339(build.created_at)
    return {
        "templateID": build.template_id,
        "buildID": build.build_id,
        "cpuCount": build.cpu_count or 0,
        "memoryMB": build.memory_mb or 0,
        "diskSizeMB": 0,
        "public": False,
        "aliases": [build.name],
        "names": [build.name],
        "createdAt": created,
        "updatedAt": created,
        "createdBy": None,
        "lastSpawnedAt": None,
        "spawnCount": 0,
        "buildCount": 0,
        "envdVersion": "",
        "buildStatus": str(build.status),
    }


def _build(t: Template) -> dict[str, Any]:
    """`TemplateBuild`: the build a template's files come from, finished when it was saved."""
    return {
        "buildID": t.build_id,
        "status": "ready",
        "createdAt": rfc3339(t.created_at),
        "updatedAt": rfc3339(t.created_at),
        "finishedAt": rfc3339(t.created_at),
        "cpuCount": t.cpu_count,
        "memoryMB": t.memory_mb,
        "diskSizeMB": t.disk_size_mb,
        "envdVersion": t.envd_version,
    }


def with_builds(t: Template, query: Mapping[str, str]) -> dict[str, Any]:
    """`TemplateWithBuilds` (also a gateway's, for a published template no live node holds): a
    template here is its one current build, paged as E2B pages builds (`limit`, then
    `nextToken` is the last build given)."""
    limit = query.get("limit", str(MAX_PAGE))
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_PAGE:
        raise APIError(400, f"limit must be between 1 and {MAX_PAGE}")
    token = query.get("nextToken")
    if token not in (None, t.build_id):
        raise APIError(400, "invalid nextToken")
    body = template_body(t)
    return {k: body[k] for k in _WITH_BUILDS} | {"builds": [] if token else [_build(t)]}


def alias_body(t: Template) -> dict[str, Any]:
    """What `GET /templates/aliases/{alias}` answers for the template."""
    return {"templateID": t.template_id, "public": t.is_public}


class TemplateUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    public: bool | None = None


class TemplateRoutes:
    def __init__(self, orchestrator: Orchestrator, builder: Builder) -> None:
        self.orc = orchestrator
        self.store = orchestrator.templates
        self.builder = builder

    def routes(self) -> list[Route]:
        return [
            Route("/templates", self.list, methods=["GET"]),
            Route("/v2/templates", self.list, methods=["GET"]),
            Route("/templates/aliases/{alias}", self.alias, methods=["GET"]),
            Route("/templates/{template_id}", self.get, methods=["GET"]),
            Route("/templates/{template_id}", self.update, methods=["PATCH"]),
            Route("/v2/templates/{template_id}", self.update, methods=["PATCH"]),
            Route("/templates/{template_id}", self.delete, methods=["DELETE"]),
        ]

    async def list(self, request: Request) -> Response:
        """The team's templates and the public ones."""
        check_query(request)
        team = team_of(request)
        latest = self.builder.latest()
        shown = [t for t in self.store.list() if t.visible_to(team)]
        listed = [template_body(t, latest.pop(t.template_id, None)) for t in shown]
        # A newest build that is ready without its template: the template was deleted since.
        listed += [
            unbuilt_body(b)
            for b in latest.values()
            if b.status is not BuildStatus.READY and b.team_id == team
        ]
        return JSONResponse(listed)

    async def alias(self, request: Request) -> Response:
        check_query(request)
        alias = unquote(request.path_params["alias"])
        try:
            template = self.store.get(alias, team_of(request))
        except TemplateNotFound as e:
            raise not_found(f"template alias '{alias}'") from e
        return JSONResponse(alias_body(template))

    def _template(self, request: Request, *, owned: bool = False) -> Template:
        """The template the path names, among those the team sees (`owned`: its own only,
        which it alone may change); 404 for any other."""
        ref = unquote(request.path_params["template_id"])
        team = team_of(request)
        try:
            template = self.store.get(ref, team)
        except TemplateNotFound as e:
            raise not_found(f"template '{ref}'") from e
        if owned and template.team_id != team:
            raise not_found(f"template '{ref}'")
        return template

    async def get(self, request: Request) -> Response:
        check_query(request, {"limit", "nextToken"})
        return JSONResponse(with_builds(self._template(request), request.query_params))

    async def update(self, request: Request) -> Response:
        """`TemplateUpdateRequest`: the owner team publishes its template (`public`), which
        every team may then start sandboxes from, or makes it private again."""
        check_query(request)
        body = await parse_body(request, TemplateUpdate)
        template = self._template(request, owned=True)
        public = body.public
        if public is not None and public != template.public:
            changed = await asyncio.to_thread(
                self.store.update,
                template.template_id,
                lambda t: dataclasses.replace(t, public=public),
            )
            if changed is None:
                raise not_found(f"template '{template.template_id}'")
            template = changed
        return JSONResponse({"names": template_body(template)["names"]})

    async def delete(self, request: Request) -> Response:
        """Delete a template, its builds under way cancelled first (as E2B does); one whose
        first build is still under way or failed (listed, but no template yet) goes too."""
        check_query(request)
        team = team_of(request)
        try:
            template = self._template(request, owned=True)
        except APIError:
            ref = unquote(request.path_params["template_id"])
            unbuilt = await self.builder.cancel_template(ref, team)
            if not unbuilt:
                raise
            for template_id in unbuilt:
                await self.builder.forget(template_id)
            return Response(status_code=204)
        await self.builder.cancel_template(template.template_id, team)
        await self.orc.delete_template(template.template_id)
        return Response(status_code=204)
