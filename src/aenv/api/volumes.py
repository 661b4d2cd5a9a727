"""Volume routes of the E2B control plane: `/volumes` (list, create) and `/volumes/{volumeID}`
(info, delete), with E2B's shapes and status codes, and the mapping of volume errors to JSON
errors for the sandbox create that mounts volumes.

A volume that sandboxes still mount is not deleted: 409 naming them (E2B's spec lists no code
for it; deleting the files under a running guest would be worse). A create names its size in
`sizeMB` (this node's field) or gets the node's default; one the host's disk above its reserve
cannot hold answers 507. Responses carry `sizeMB` (null for a volume made before sizes).

E2B's volume content API (`/volumecontent/{volumeID}/...`: files of a volume without a sandbox)
is `api.volume_content`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError, not_found
from aenv.api.internal_models import Refusal
from aenv.api.models import NewVolume, SandboxVolumeMount
from aenv.api.requests import check_query, parse_body
from aenv.api.scope import check_disk, team_of
from aenv.api.volume_content import VolumeContentRoutes
from aenv.orchestrator.catalog import SandboxRecord, VolumeMount, VolumeNameTaken, VolumeRecord
from aenv.orchestrator.lifecycle import Orchestrator
from aenv.orchestrator.volumes import (
    BadMount,
    NoRoom,
    VolumeInUse,
    VolumeNotFound,
    VolumeStore,
)


def resolve_mounts(
    store: VolumeStore, mounts: Iterable[SandboxVolumeMount] | None, team_id: str
) -> tuple[VolumeMount, ...]:
    """A create's `volumeMounts` (names of `team_id`'s volumes), or a 400 naming the unknown
    volume or the bad path."""
    try:
        return store.resolve(((m.name, m.path) for m in mounts or ()), team_id)
    except (VolumeNotFound, BadMount) as e:
        raise APIError(400, f"volumeMounts: {e}") from e


def mounts_body(store: VolumeStore, record: SandboxRecord) -> list[dict[str, str]]:
    """`SandboxVolumeMount`s of a listed sandbox: volume names, not ids."""
    names = {v.id: v.name for v in store.list()}
    return [
        {"name": names.get(m.volume_id, m.volume_id), "path": m.path} for m in record.volume_mounts
    ]


class VolumeRoutes:
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orc = orchestrator
        self.store = orchestrator.volumes

    def routes(self) -> list[Route]:
        return [
            Route("/volumes", self.list, methods=["GET"]),
            Route("/volumes", self.create, methods=["POST"]),
            Route("/volumes/{volume_id}", self.info, methods=["GET"]),
            Route("/volumes/{volume_id}", self.delete, methods=["DELETE"]),
            *VolumeContentRoutes(self.orc).routes(),
        ]

    def _with_token(self, volume: VolumeRecord) -> dict[str, Any]:
        # No `domain`: the spec sends one only for teams on a custom (BYOC) cluster.
        return {
            "volumeID": volume.id,
            "name": volume.name,
            "token": volume.token,
            "sizeMB": volume.size_mb,
        }

    def _get(self, request: Request) -> VolumeRecord:
        volume_id = request.path_params["volume_id"]
        try:
            return self.store.get(volume_id)
        except VolumeNotFound as e:
            raise not_found(f"volume '{volume_id}'") from e

    async def list(self, request: Request) -> Response:
        check_query(request)
        volumes = self.store.list(team_of(request))
        return JSONResponse([{"volumeID": v.id, "name": v.name} for v in volumes])

    async def create(self, request: Request) -> Response:
        check_query(request)
        body = await parse_body(request, NewVolume)
        try:
            team = team_of(request)
            check_disk(self.orc, team, body.size_mb or self.store.default_size_mb)
            volume = await self.store.create(body.name, body.size_mb, team)
        except (BadMount, VolumeNameTaken) as e:
            raise APIError(400, str(e)) from e
        except NoRoom as e:
            raise APIError(507, str(e), refusal=Refusal.FULL) from e
        return JSONResponse(self._with_token(volume), status_code=201)

    async def info(self, request: Request) -> Response:
        check_query(request)
        return JSONResponse(self._with_token(self._get(request)))

    async def delete(self, request: Request) -> Response:
        check_query(request)
        volume = self._get(request)
        try:
            await self.store.delete(volume.id, self.orc.catalog.list())
        except VolumeNotFound as e:
            raise not_found(f"volume '{volume.id}'") from e
        except VolumeInUse as e:
            raise APIError(409, str(e)) from e
        return Response(status_code=204)
