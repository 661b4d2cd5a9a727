"""E2B's volume content API: `/volumecontent/{volumeID}/{path,dir,file}`, the files of a volume
without a sandbox, as E2B's `openapi-volumecontent.yml` defines them (stat, metadata change,
delete; list and make a directory; download and upload a file).

A request carries the volume's token (`Authorization: Bearer`, from `POST /volumes` or
`GET /volumes/{id}`), not an API key: a wrong or missing one answers 401, also for a volume that
does not exist. Paths are served by `orchestrator.volume_files`, which never follows a link a
guest planted. Errors are `{"code": int, "message": str}` like every other route here (E2B's
content spec types `code` as a string; its SDKs read only the message and the status).
Uploads are bounded by `MAX_UPLOAD`, by the host's free disk above its reserve and by the
volume's own free space (507). Modes with setuid or setgid bits, or a file type (a device
node...), are refused (400): volumes are mounted `nosuid,nodev` in guests anyway, and what the
API sets is what guests see.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import hmac
import os
import shutil
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from aenv.api.errors import APIError
from aenv.api.requests import check_query, parse_body
from aenv.orchestrator.lifecycle import Orchestrator
from aenv.orchestrator.reserve import HostReserve
from aenv.orchestrator.volume_entries import Entry, Owner
from aenv.orchestrator.volume_files import MAX_DEPTH, Problem, VolumeFiles, VolumePathError
from aenv.orchestrator.volumes import VolumeNotFound

PREFIX = "/volumecontent/"
MAX_UPLOAD = 4 << 30
_CHUNK = 1 << 20
_UINT32 = (1 << 32) - 1
_SETID = stat.S_ISUID | stat.S_ISGID
_STATUS = {
    Problem.NOT_FOUND: 404,
    Problem.REFUSED: 400,
    Problem.CONFLICT: 409,
    Problem.NO_SPACE: 507,
}
T = TypeVar("T")


class PathMetadata(BaseModel):
    """`PATCH /volumecontent/{id}/path`'s body."""

    model_config = ConfigDict(extra="forbid")
    uid: int | None = Field(default=None, ge=0, le=_UINT32)
    gid: int | None = Field(default=None, ge=0, le=_UINT32)
    mode: int | None = Field(default=None, ge=0)

    @field_validator("mode")
    @classmethod
    def _mode(cls, mode: int | None) -> int | None:
        if mode is not None and (problem := mode_problem(mode)):
            raise ValueError(problem)
        return mode


def mode_problem(mode: int) -> str | None:
    """Why a volume entry may not get `mode`, or None: only permission bits, no setuid/setgid
    (a set-uid root binary, or a device node, planted by one guest would act in another)."""
    if stat.S_IFMT(mode) or mode > 0o7777:
        kind = "a device or other file type" if stat.S_IFMT(mode) else "bits past 07777"
        return f"mode {mode:#o} carries {kind}: only permission bits are accepted"
    if mode & _SETID:
        return f"mode {mode:#o} sets setuid or setgid bits (04000, 02000), refused in volumes"
    return None


def _time(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat().replace("+00:00", "Z")


def entry_body(entry: Entry) -> dict[str, Any]:
    """A `VolumeEntryStat`."""
    body: dict[str, Any] = {
        "name": entry.name,
        "type": entry.type.value,
        "path": entry.path,
        "size": entry.size,
        "mode": entry.mode,
        "uid": entry.uid,
        "gid": entry.gid,
        "atime": _time(entry.atime),
        "mtime": _time(entry.mtime),
        "ctime": _time(entry.ctime),
    }
    if entry.target is not None:
        body["target"] = entry.target
    return body


def _number(request: Request, name: str, low: int, high: int) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise APIError(400, f"query parameter '{name}' must be an integer from {low} to {high}")
    return int(raw)


def _flag(request: Request, name: str) -> bool:
    raw = request.query_params.get(name, "false").lower()
    if raw not in ("true", "false"):
        raise APIError(400, f"query parameter '{name}' must be true or false")
    return raw == "true"


def _owner(request: Request) -> Owner:
    mode = _number(request, "mode", 0, _UINT32)
    if mode is not None and (problem := mode_problem(mode)):
        raise APIError(400, f"query parameter 'mode': {problem}")
    return Owner(
        uid=_number(request, "uid", 0, _UINT32),
        gid=_number(request, "gid", 0, _UINT32),
        mode=mode,
    )


async def _files(call: Callable[[], T]) -> T:
    """Runs a blocking `VolumeFiles` call in a thread, its failures as JSON errors."""
    try:
        return await asyncio.to_thread(call)
    except VolumePathError as e:
        raise APIError(_STATUS[e.problem], str(e)) from e


class VolumeContentRoutes:
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.store = orchestrator.volumes
        self.files = VolumeFiles(orchestrator.config.paths.volumes)
        config = orchestrator.config
        self.reserve = HostReserve(config.home, config.reserve_disk_mb, config.reserve_memory_mb)

    def routes(self) -> list[Route]:
        base = PREFIX + "{volume_id}"
        return [
            Route(base + "/path", self._guard(self.stat), methods=["GET"]),
            Route(base + "/path", self._guard(self.patch), methods=["PATCH"]),
            Route(base + "/path", self._guard(self.delete), methods=["DELETE"]),
            Route(base + "/dir", self._guard(self.list_dir), methods=["GET"]),
            Route(base + "/dir", self._guard(self.make_dir), methods=["POST"]),
            Route(base + "/file", self._guard(self.read), methods=["GET"]),
            Route(base + "/file", self._guard(self.write), methods=["PUT"]),
        ]

    def _guard(
        self, handler: Callable[[Request, str, str], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """The handler, called with the volume id and the `path` query once the token is the
        volume's."""

        async def guarded(request: Request) -> Response:
            volume_id = request.path_params["volume_id"]
            given = request.headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            try:
                expected = self.store.get(volume_id).token
            except VolumeNotFound:
                expected = ""
            if not token or not expected or not hmac.compare_digest(token, expected):
                raise APIError(401, "a valid volume token is required: Authorization: Bearer")
            path = request.query_params.get("path", "")
            if not path:
                raise APIError(400, "query parameter 'path' is required")
            return await handler(request, volume_id, path)

        return guarded

    async def stat(self, request: Request, volume_id: str, path: str) -> Response:
        check_query(request, ("path",))
        entry = await _files(lambda: self.files.stat(volume_id, path))
        return JSONResponse(entry_body(entry))

    async def patch(self, request: Request, volume_id: str, path: str) -> Response:
        check_query(request, ("path",))
        body = await parse_body(request, PathMetadata)
        owner = Owner(uid=body.uid, gid=body.gid, mode=body.mode)
        entry = await _files(lambda: self.files.set_owner(volume_id, path, owner))
        return JSONResponse(entry_body(entry))

    async def delete(self, request: Request, volume_id: str, path: str) -> Response:
        check_query(request, ("path",))
        await _files(lambda: self.files.remove(volume_id, path))
        return Response(status_code=204)

    async def list_dir(self, request: Request, volume_id: str, path: str) -> Response:
        check_query(request, ("path", "depth"))
        depth = _number(request, "depth", 1, MAX_DEPTH) or 1
        entries = await _files(lambda: self.files.listing(volume_id, path, depth))
        return JSONResponse([entry_body(e) for e in entries])

    async def make_dir(self, request: Request, volume_id: str, path: str) -> Response:
        check_query(request, ("path", "uid", "gid", "mode", "force"))
        owner, parents = _owner(request), _flag(request, "force")
        entry = await _files(lambda: self.files.make_dir(volume_id, path, owner, parents))
        return JSONResponse(entry_body(entry), status_code=201)

    async def read(self, request: Request, volume_id: str, path: str) -> Response:
        check_query(request, ("path",))
        fd, _ = await _files(lambda: self.files.open_read(volume_id, path))
        return StreamingResponse(_chunks(fd), media_type="application/octet-stream")

    async def write(self, request: Request, volume_id: str, path: str) -> Response:
        """Streams the body into a new file; `force` also makes missing parent directories."""
        check_query(request, ("path", "uid", "gid", "mode", "force"))
        owner, parents = _owner(request), _flag(request, "force")
        limit = await self._upload_limit(request, volume_id)
        upload = await _files(lambda: self.files.begin_write(volume_id, path, owner, parents))
        try:
            async for chunk in request.stream():
                if upload.size + len(chunk) > limit:
                    raise self._too_large(limit)
                await _files(functools.partial(upload.write, chunk))
            entry = await _files(upload.commit)
        finally:
            await asyncio.to_thread(upload.abort)
        return JSONResponse(entry_body(entry), status_code=201)

    async def _upload_limit(self, request: Request, volume_id: str) -> int:
        """What one upload may write: `MAX_UPLOAD`, or less when the host's free disk above its
        reserve, or the volume's free space, is less; a declared length past it is refused
        before anything is written (a write past the volume's size fails anyway: ENOSPC)."""
        free_mb = await asyncio.to_thread(self.reserve.free_disk_mb)
        volume_free = await asyncio.to_thread(self._volume_free, volume_id)
        limit = min(MAX_UPLOAD, max(free_mb - self.reserve.disk_mb, 0) << 20, volume_free)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise self._too_large(limit)
        return limit

    def _volume_free(self, volume_id: str) -> int:
        """The free space of the volume's filesystem (the host's, for a volume with no size)."""
        try:
            return shutil.disk_usage(self.files.root / volume_id).free
        except FileNotFoundError as e:
            raise APIError(404, f"volume '{volume_id}' has no files") from e

    @staticmethod
    def _too_large(limit: int) -> APIError:
        if limit >= MAX_UPLOAD:
            return APIError(413, f"a volume file upload is at most {MAX_UPLOAD} bytes")
        return APIError(507, f"not enough disk: the volume or the host can take {limit} more bytes")


async def _chunks(fd: int) -> AsyncIterator[bytes]:
    """The file to its end, whatever size it had when opened; closes `fd`."""
    try:
        while chunk := await asyncio.to_thread(os.read, fd, _CHUNK):
            yield chunk
    finally:
        os.close(fd)
