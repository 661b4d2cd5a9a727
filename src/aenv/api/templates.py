"""Template routes of the E2B control plane: list, alias lookup, delete."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import not_found
from aenv.api.sandboxes import rfc3339
from aenv.orchestrator.lifecycle import Orchestrator
from aenv.orchestrator.templates import Template, TemplateNotFound


def _template(t: Template) -> dict[str, Any]:
    return {
        "templateID": t.template_id,
        "buildID": t.build_id,
        "cpuCount": t.cpu_count,
        "memoryMB": t.memory_mb,
        "diskSizeMB": t.disk_size_mb,
        "public": False,
        "aliases": list(t.aliases),
        "names": list(t.aliases) or [t.template_id],
        "createdAt": rfc3339(t.created_at),
        "updatedAt": rfc3339(t.created_at),
        "createdBy": None,
        "lastSpawnedAt": None,
        "spawnCount": 0,
        "buildCount": 1,
        "envdVersion": t.envd_version,
        "buildStatus": "ready",
    }


class TemplateRoutes:
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orc = orchestrator
        self.store = orchestrator.templates

    def routes(self) -> list[Route]:
        return [
            Route("/templates", self.list, methods=["GET"]),
            Route("/v2/templates", self.list, methods=["GET"]),
            Route("/templates/aliases/{alias}", self.alias, methods=["GET"]),
            Route("/templates/{template_id}", self.delete, methods=["DELETE"]),
        ]

    async def list(self, _: Request) -> Response:
        return JSONResponse([_template(t) for t in self.store.list()])

    async def alias(self, request: Request) -> Response:
        alias = unquote(request.path_params["alias"])
        try:
            template = self.store.get(alias)
        except TemplateNotFound as e:
            raise not_found(f"template alias '{alias}'") from e
        return JSONResponse({"templateID": template.template_id, "public": False})

    async def delete(self, request: Request) -> Response:
        ref = unquote(request.path_params["template_id"])
        try:
            template = self.store.get(ref)
        except TemplateNotFound as e:
            raise not_found(f"template '{ref}'") from e
        await self.orc.delete_template(template.template_id)
        return Response(status_code=204)
