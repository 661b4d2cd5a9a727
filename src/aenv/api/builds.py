"""Template build routes of the E2B control plane, as `Template.build` in the SDKs calls them:
request a build, upload the files of its COPY steps, start it, poll its status and logs; tags.

Uploads come back to this server (`PUT /templates/{id}/files/{hash}`, the URL the files route
hands out) and are kept under `$AENV_HOME/build-files/<template id>/<hash>`
(`orchestrator.build_files`, which says what is checked when); the build checks them against
the hash the SDK computed before it copies them into the VM.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError, not_found
from aenv.api.requests import check_query, parse_body, query_int
from aenv.api.sandboxes import rfc3339
from aenv.api.scope import team_of
from aenv.oci import Credentials
from aenv.orchestrator.build_files import UploadRefused, declared_sha256
from aenv.orchestrator.build_logs import LEVELS, LogEntry
from aenv.orchestrator.build_records import Build, BuildSpec, BuildStatus, Step
from aenv.orchestrator.build_steps import StepType
from aenv.orchestrator.builds import FILES_HASH, Builder, split_name
from aenv.orchestrator.templates import Template, TemplateNotFound

NAME = re.compile(r"^[a-z0-9][a-z0-9._/-]{0,127}$")
TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_STEPS = 1000
MAX_LOG_PAGE = 100
# Sandbox sizes a build may ask for (E2B's own bounds are per plan).
MAX_VCPUS = 16
MIN_MEMORY_MB = 128
MAX_MEMORY_MB = 65536


class _Body(BaseModel):
    """Undeclared keys are refused (api/requests.py), as E2B fields not implemented here."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")


class BuildRequestBody(_Body):
    name: str | None = Field(default=None, max_length=128)
    alias: str | None = Field(default=None, max_length=128)  # deprecated spelling of `name`
    tags: list[str] = Field(default_factory=list, max_length=64)
    cpu_count: int | None = Field(default=None, alias="cpuCount", ge=1, le=MAX_VCPUS)
    memory_mb: int | None = Field(
        default=None, alias="memoryMB", ge=MIN_MEMORY_MB, le=MAX_MEMORY_MB
    )


class StepBody(_Body):
    type: str
    args: list[str] = Field(default_factory=list, max_length=1024)
    files_hash: str | None = Field(default=None, alias="filesHash")
    force: bool = False
    # The client uploads a COPY step's files again even when their hash is known (the files
    # route always hands out the upload URL for that); the step then runs uncached too.
    force_upload: bool | None = Field(default=None, alias="forceUpload")


class RegistryBody(_Body):
    type: str
    username: str | None = None
    password: str | None = None


class BuildStartBody(_Body):
    from_image: str | None = Field(default=None, alias="fromImage")
    from_template: str | None = Field(default=None, alias="fromTemplate")
    from_image_registry: RegistryBody | None = Field(default=None, alias="fromImageRegistry")
    force: bool = False
    steps: list[StepBody] = Field(default_factory=list, max_length=MAX_STEPS)
    start_cmd: str | None = Field(default=None, alias="startCmd")
    ready_cmd: str | None = Field(default=None, alias="readyCmd")


class AssignTagsBody(_Body):
    target: str
    tags: list[str] = Field(max_length=64)


class DeleteTagsBody(_Body):
    name: str
    tags: list[str] = Field(max_length=64)


def _entry(entry: LogEntry) -> dict[str, Any]:
    body = {"timestamp": rfc3339(entry.timestamp), "message": entry.message, "level": entry.level}
    if entry.step is not None:
        body["step"] = entry.step
    return body


def check_tags(tags: list[str]) -> None:
    bad = [t for t in tags if not TAG.match(t)]
    if bad:
        raise APIError(400, f"invalid tags {bad}: letters, digits, '.', '_', '-'")


class BuildRoutes:
    def __init__(self, builder: Builder) -> None:
        self.builder = builder
        self.store = builder.orc.templates

    def routes(self) -> list[Route]:
        return [
            Route("/v3/templates", self.request, methods=["POST"]),
            Route("/templates/{template_id}/files/{hash}", self.files, methods=["GET"]),
            Route("/templates/{template_id}/files/{hash}", self.upload, methods=["PUT"]),
            Route("/v2/templates/{template_id}/builds/{build_id}", self.start, methods=["POST"]),
            Route(
                "/templates/{template_id}/builds/{build_id}/status", self.status, methods=["GET"]
            ),
            Route("/templates/{template_id}/builds/{build_id}/logs", self.logs, methods=["GET"]),
            Route("/templates/tags", self.assign_tags, methods=["POST"]),
            Route("/templates/tags", self.delete_tags, methods=["DELETE"]),
            Route("/templates/{template_id}/tags", self.list_tags, methods=["GET"]),
        ]

    def _known(self, template_id: str, team_id: str) -> str:
        """The id of a template of `team_id` or of one it is building, by id or name; 404
        otherwise."""
        builds = [b for b in self.builder.builds_of(template_id) if b.team_id == team_id]
        if builds:
            return builds[-1].template_id
        return self._owned(template_id, team_id).template_id

    def _owned(self, ref: str, team_id: str, *, public: bool = False) -> Template:
        """The template `ref` of `team_id` (or a public one, with `public`); 404 otherwise."""
        try:
            template = self.store.get(ref, team_id)
        except TemplateNotFound as e:
            raise not_found(f"template '{ref}'") from e
        if template.team_id != team_id and not public:
            raise not_found(f"template '{ref}'")
        return template

    def _build(self, request: Request) -> Build:
        template_id = unquote(request.path_params["template_id"])
        build_id = request.path_params["build_id"]
        build = self.builder.get(template_id, build_id)
        if build is None or build.team_id != team_of(request):
            raise not_found(f"build '{build_id}' of template '{template_id}'")
        return build

    async def request(self, request: Request) -> Response:
        check_query(request)
        body = await parse_body(request, BuildRequestBody)
        name = body.name or body.alias
        if not name:
            raise APIError(400, "name is required")
        alias, tag = split_name(name)
        if not NAME.match(alias):
            raise APIError(
                400, f"invalid name '{alias}': lower-case letters, digits, '.', '_', '-'"
            )
        check_tags([*body.tags, *([tag] if tag else [])])
        if body.memory_mb is not None and body.memory_mb % 2:
            raise APIError(400, "memoryMB must be an even number")
        build = self.builder.request(
            name, body.tags, body.cpu_count, body.memory_mb, team_of(request)
        )
        return JSONResponse(
            {
                "templateID": build.template_id,
                "buildID": build.build_id,
                "public": False,
                "names": [build.name],
                "tags": list(build.tags),
                "aliases": [build.name],
            },
            status_code=202,
        )

    def _hash(self, request: Request) -> str:
        files_hash: str = request.path_params["hash"]
        if not FILES_HASH.match(files_hash):
            raise APIError(400, "the files hash must be 64 lower-case hex digits (sha256)")
        return files_hash

    async def files(self, request: Request) -> Response:
        check_query(request)
        template_id = self._known(unquote(request.path_params["template_id"]), team_of(request))
        path = self.builder.files.path(template_id, self._hash(request))
        # Found present, the upload is used: the SDK skips uploading it for a build to come.
        present = await asyncio.to_thread(self.builder.files.touch, path)
        # The URL is handed out also when the files are present, as E2B does: a COPY step with
        # `forceUpload` uploads them again. The upload goes to this server, which wants the API
        # key: the client is told to send the one it authenticated this request with.
        key = {k: v for k, v in request.headers.items() if k in ("x-api-key", "authorization")}
        return JSONResponse(
            {"present": present, "url": str(request.url.replace(query="")), "headers": key},
            status_code=201,
        )

    async def upload(self, request: Request) -> Response:
        """The tar (gzipped or not) of a COPY step's files, stored under its hash; checked
        against the hash when a build uses it (the hash covers the step's paths, which only the
        build knows)."""
        check_query(request)
        template_id = self._known(unquote(request.path_params["template_id"]), team_of(request))
        files_hash = self._hash(request)
        length = request.headers.get("content-length")
        try:
            await self.builder.files.store(
                template_id,
                files_hash,
                request.stream(),
                int(length) if length is not None and length.isdigit() else None,
                declared_sha256(dict(request.headers)),
            )
        except UploadRefused as e:
            raise APIError(e.status, str(e)) from e
        return Response(status_code=201)

    async def start(self, request: Request) -> Response:
        check_query(request)
        body = await parse_body(request, BuildStartBody, optional=True)
        build = self._build(request)
        if body.from_image and body.from_template:
            raise APIError(400, "give fromImage or fromTemplate, not both")
        for index, step in enumerate(body.steps, 1):
            if step.type not in set(StepType):
                raise APIError(400, f"step {index}: unknown type '{step.type}'")
            if step.type == "COPY" and not (step.files_hash and FILES_HASH.match(step.files_hash)):
                raise APIError(400, f"step {index}: COPY needs a filesHash (sha256 hex)")
            if step.force_upload and step.type != "COPY":
                raise APIError(400, f"step {index}: forceUpload applies to COPY steps only")
        credentials = None
        if body.from_image_registry is not None:
            registry = body.from_image_registry
            if registry.type != "registry" or registry.username is None:
                raise APIError(400, "fromImageRegistry: only type 'registry' with a username")
            credentials = Credentials(registry.username, registry.password or "")
        if build.status is not BuildStatus.WAITING:
            raise APIError(409, f"build {build.build_id} was already started")
        spec = BuildSpec(
            from_template=body.from_template,
            from_image=body.from_image,
            steps=tuple(
                Step(StepType(s.type), tuple(s.args), s.force or bool(s.force_upload), s.files_hash)
                for s in body.steps
            ),
            start_cmd=body.start_cmd or None,
            ready_cmd=body.ready_cmd or None,
            force=body.force,
            credentials=credentials,
        )
        self.builder.start(build, spec)
        return Response(status_code=202)

    async def status(self, request: Request) -> Response:
        check_query(request, {"logsOffset", "limit", "level"})
        build = self._build(request)
        offset = query_int(request, "logsOffset", 0, 0, 2**31 - 1)
        limit = query_int(request, "limit", MAX_LOG_PAGE, 0, MAX_LOG_PAGE)
        level = request.query_params.get("level")
        if level is not None and level not in LEVELS:
            raise APIError(400, f"level must be one of {', '.join(LEVELS)}")
        # The SDK counts the entries it got into its next offset, so filter before paging.
        build.logs.flush()
        entries = await asyncio.to_thread(build.logs.page, offset, limit, level or LEVELS[0])
        body: dict[str, Any] = {
            "templateID": build.template_id,
            "buildID": build.build_id,
            "status": build.status,
            "logs": [],
            "logEntries": [_entry(e) for e in entries],
        }
        if build.reason is not None:
            body["reason"] = {"message": str(build.reason)}
            if build.reason.step is not None:
                body["reason"]["step"] = build.reason.step
        return JSONResponse(body)

    async def logs(self, request: Request) -> Response:
        """`TemplateBuildLogsResponse`: from `cursor` (Unix ms) on, `forward` oldest first or
        `backward` newest first, at least `level`. Logs live with the build (E2B's `temporary`
        source); there is no `persistent` store to read."""
        check_query(request, {"cursor", "limit", "direction", "level", "source"})
        build = self._build(request)
        q = request.query_params
        cursor = query_int(request, "cursor", -1, 0, 2**63 - 1)
        limit = query_int(request, "limit", MAX_LOG_PAGE, 0, MAX_LOG_PAGE)
        direction = q.get("direction", "forward")
        if direction not in ("forward", "backward"):
            raise APIError(400, "direction must be 'forward' or 'backward'")
        level = q.get("level", LEVELS[0])
        if level not in LEVELS:
            raise APIError(400, f"level must be one of {', '.join(LEVELS)}")
        if q.get("source", "temporary") != "temporary":
            raise APIError(400, "source 'persistent' is not supported here: logs are temporary")
        build.logs.flush()
        entries = await asyncio.to_thread(
            build.logs.around,
            cursor if cursor >= 0 else None,
            limit,
            direction == "backward",
            level,
        )
        return JSONResponse({"logs": [_entry(e) for e in entries]})

    async def assign_tags(self, request: Request) -> Response:
        check_query(request)
        body = await parse_body(request, AssignTagsBody)
        name, tag = split_name(body.target)
        check_tags(body.tags)
        template = self._owned(name, team_of(request))
        known = {t.tag: t.build_id for t in self.builder.tags.of(template.template_id)}
        build_id = known.get(tag or "latest", template.build_id)
        self.builder.tags.assign(template.template_id, body.tags, build_id)
        return JSONResponse({"tags": body.tags, "buildID": build_id}, status_code=201)

    async def delete_tags(self, request: Request) -> Response:
        check_query(request)
        body = await parse_body(request, DeleteTagsBody)
        name, _ = split_name(body.name)
        template = self._owned(name, team_of(request))
        self.builder.tags.remove(template.template_id, body.tags)
        return Response(status_code=204)

    async def list_tags(self, request: Request) -> Response:
        check_query(request)
        template_id = unquote(request.path_params["template_id"])
        template = self._owned(template_id, team_of(request), public=True)
        tags = self.builder.tags.of(template.template_id)
        return JSONResponse(
            [
                {"tag": t.tag, "buildID": t.build_id, "createdAt": rfc3339(t.created_at)}
                for t in tags
            ]
        )
