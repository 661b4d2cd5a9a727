"""The guest of a double VM: what it holds (`Guest`) and the envd it answers with (`envd_app`).

The double envd speaks the host-facing part of the protocol the orchestrator and template builds
use (`/health`, `/init`, `/sync`, `/metrics`, `/envs`, `/files`, and the Connect RPC
`process.Process/Start`) with envd's token rules, on a real socket. It changes nothing on the
host (the real envd sets the hostname and the clock, and reseeds the RNG) and runs no commands:
a command is appended to the guest file `COMMANDS` and exits 0, or N for `exit N`; its output
is `ran <command>`, or for `seq N` the numbers 1 to N, one a line (a log flood). Template builds'
`/aenv/copy` is answered for an archive the guest holds, and recorded in `copies`;
`/aenv/egress-ca` in `trusted` (its variables join the env as the real envd's do).

A file written through `/files` is read as it arrives; one larger than `SMALL_FILE` is kept as
its size and sha256 (`<N bytes, sha256 HEX>`), so a test of a large upload measures the node,
not the double.

A guest's files are in two places, as in a real guest: `written` is the page cache (what the
guest wrote since its last flush), `disk` what reached its disk. A filesystem-only save keeps
only `disk`; `/sync` moves `written` there first. A full save keeps both (it is in memory).
"""

from __future__ import annotations

import base64
import hashlib
import json
import posixpath
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from aenv.envd import trust
from aenv.envd.auth import TOKEN_HEADER
from aenv.envd.proto.process import process_pb as pb
from aenv.envd.proto.process.process_connect import Process, ProcessASGIApplication

SMALL_FILE = 1 << 16


@dataclass
class Guest:
    token: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    hostname: str = "sandbox"
    default_user: str | None = None
    default_workdir: str | None = None
    written: dict[str, str] = field(default_factory=dict)
    disk: dict[str, str] = field(default_factory=dict)
    # Not saved: what this run of the guest was asked (the tests read it).
    inits: int = 0
    # What the newest `/init` asked to mount ({"tag", "path"} each), and whether they are
    # mounted (not since a release); tests set `volumes_busy` to play a volume in use.
    volume_mounts: list[dict[str, str]] = field(default_factory=list)
    volumes_mounted: bool = False
    volumes_busy: bool = False
    volume_releases: int = 0
    syncs: int = 0
    metrics_asked: int = 0  # `/metrics` requests answered
    runs: list[tuple[str, str]] = field(default_factory=list)  # (user, command)
    # Pids of commands envd runs (`process.Process/List`); tests set them.
    running: list[int] = field(default_factory=list)
    copies: list[dict[str, Any]] = field(default_factory=list)  # `/aenv/copy` requests
    trusted: list[str] = field(default_factory=list)  # `/aenv/egress-ca` certificates

    def write(self, path: str, content: str) -> None:
        self.written[path] = content

    def read(self, path: str) -> str | None:
        return self.written.get(path, self.disk.get(path))

    def memory(self) -> dict[str, Any]:
        """What a full save keeps besides the disk."""
        state = asdict(self)
        transients = (
            "disk",
            "inits",
            "syncs",
            "runs",
            "metrics_asked",
            "volume_releases",
            "copies",
        )
        for transient in transients:
            del state[transient]
        return state

    @classmethod
    def restored(cls, memory: dict[str, Any], disk: dict[str, str]) -> Guest:
        return cls(**memory, disk=dict(disk))

    @classmethod
    def booted(cls, disk: dict[str, str]) -> Guest:
        """A cold boot: the disk's files, nothing of a previous run's memory."""
        return cls(disk=dict(disk))


COMMANDS = "/var/log/double-commands"


# The generated Protocol is untyped (its module is excluded from type checks); subclassing it
# keeps its UNIMPLEMENTED answers for the methods the double leaves out.
class _Processes(Process):  # type: ignore[misc]
    """`process.Process/Start` of the double: records the command, answers start, output, end;
    `List` answers the guest's `running` pids."""

    def __init__(self, guest: Guest) -> None:
        self.guest = guest

    async def list(
        self, request: pb.ListRequest, ctx: RequestContext[pb.ListRequest, pb.ListResponse]
    ) -> pb.ListResponse:
        if (
            self.guest.token is not None
            and ctx.request_headers.get(TOKEN_HEADER) != self.guest.token
        ):
            raise ConnectError(Code.UNAUTHENTICATED, "unauthorized")
        return pb.ListResponse(processes=[pb.ProcessInfo(pid=pid) for pid in self.guest.running])

    async def start(
        self, request: pb.StartRequest, ctx: RequestContext[pb.StartRequest, pb.StartResponse]
    ) -> AsyncIterator[pb.StartResponse]:
        headers = ctx.request_headers
        if self.guest.token is not None and headers.get(TOKEN_HEADER) != self.guest.token:
            raise ConnectError(Code.UNAUTHENTICATED, "unauthorized")
        basic = headers.get("authorization", "Basic Og==").removeprefix("Basic ")
        user = base64.b64decode(basic).decode().partition(":")[0]
        command = request.process.args[-1] if request.process.args else request.process.cmd
        self.guest.runs.append((user, command))
        code = int(command.removeprefix("exit ")) if command.startswith("exit ") else 0
        if code == 0:
            done = self.guest.read(COMMANDS) or ""
            self.guest.write(COMMANDS, done + command + "\n")
        yield _event(Oneof("start", pb.ProcessEvent.StartEvent(pid=1)))
        for chunk in _output(command):
            data = pb.ProcessEvent.DataEvent(output=Oneof("stdout", chunk))
            yield _event(Oneof("data", data))
        yield _event(Oneof("end", pb.ProcessEvent.EndEvent(exit_code=code, exited=True)))


def _event(event: Oneof[Any, Any]) -> pb.StartResponse:
    return pb.StartResponse(event=pb.ProcessEvent(event=event))


def _output(command: str) -> Iterator[bytes]:
    """What a command prints, in chunks of at most 64 KiB as envd sends them."""
    if not (command.startswith("seq ") and command[4:].isdigit()):
        yield f"ran {command}\n".encode()
        return
    chunk = bytearray()
    for n in range(1, int(command[4:]) + 1):
        chunk += b"%d\n" % n
        if len(chunk) >= 1 << 16:
            yield bytes(chunk)
            chunk.clear()
    if chunk:
        yield bytes(chunk)


def envd_app(guest: Guest) -> ASGIApp:
    def authorized(request: Request) -> bool:
        return guest.token is None or request.headers.get(TOKEN_HEADER) == guest.token

    def unauthorized() -> Response:
        return JSONResponse({"code": 401, "message": "unauthorized"}, status_code=401)

    async def health(_: Request) -> Response:
        return Response(status_code=204)

    async def init(request: Request) -> Response:
        body = json.loads(await request.body() or b"{}")
        if not (authorized(request) or body.get("accessToken") == guest.token):
            return JSONResponse({"code": 401, "message": "token reset refused"}, status_code=401)
        if body.get("envVars") is not None:
            guest.env = dict(body["envVars"])
        guest.token = body.get("accessToken") or None
        guest.hostname = body.get("hostname") or guest.hostname
        guest.default_user = body.get("defaultUser", guest.default_user)
        guest.default_workdir = body.get("defaultWorkdir", guest.default_workdir)
        guest.volume_mounts = body.get("volumeMounts", [])
        guest.volumes_mounted = bool(guest.volume_mounts)
        guest.inits += 1
        return Response(status_code=204)

    async def egress_ca(request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        guest.trusted.append(json.loads(await request.body())["certificate"])
        guest.env = {**trust.variables(), **guest.env}
        return Response(status_code=204)

    async def sync(request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        guest.disk.update(guest.written)
        guest.written.clear()
        guest.syncs += 1
        return Response(status_code=204)

    async def release_volumes(request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        if guest.volumes_busy:
            return JSONResponse({"code": 409, "message": "volume busy"}, status_code=409)
        guest.volumes_mounted = False
        guest.volume_releases += 1
        return Response(status_code=204)

    async def mount_volumes(request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        guest.volumes_mounted = True
        return Response(status_code=204)

    async def metrics(request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        guest.metrics_asked += 1
        sample = {"ts": 0, "cpu_count": 1, "cpu_used_pct": 1.5, "mem_total": 512 << 20}
        sample |= {"mem_used": 100 << 20, "disk_used": 1 << 20, "disk_total": 2 << 30}
        return JSONResponse(sample)

    async def envs(request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        return JSONResponse(guest.env)

    async def read_file(request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        content = guest.read(request.query_params.get("path", ""))
        if content is None:
            return JSONResponse({"code": 404, "message": "no such file"}, status_code=404)
        return Response(content.encode())

    async def write_file(request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        form = await request.form()
        upload = form["file"]
        assert not isinstance(upload, str)
        digest, size, small = hashlib.sha256(), 0, b""
        while chunk := await upload.read(1 << 16):
            digest.update(chunk)
            size += len(chunk)
            small = (small + chunk)[: SMALL_FILE + 1]
        content = small.decode(errors="replace")
        if size > SMALL_FILE:
            content = f"<{size} bytes, sha256 {digest.hexdigest()}>"
        path = request.query_params["path"]
        guest.write(path, content)
        # envd's entry for it, as the SDK's files.write reads it.
        return JSONResponse([{"name": posixpath.basename(path), "type": "file", "path": path}])

    async def copy(request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        body = await request.json()
        if guest.read(body["archive"]) is None:
            return JSONResponse({"code": 400, "message": "no such archive"}, status_code=400)
        guest.copies.append(body)
        return JSONResponse({"placed": [body["dest"]]})

    plain = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/init", init, methods=["POST"]),
            Route("/sync", sync, methods=["POST"]),
            Route("/aenv/volumes/release", release_volumes, methods=["POST"]),
            Route("/aenv/volumes/mount", mount_volumes, methods=["POST"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/envs", envs, methods=["GET"]),
            Route("/files", read_file, methods=["GET"]),
            Route("/files", write_file, methods=["POST"]),
            Route("/aenv/copy", copy, methods=["POST"]),
            Route("/aenv/egress-ca", egress_ca, methods=["POST"]),
        ]
    )
    rpc = ProcessASGIApplication(_Processes(guest))

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/process.Process/"):
            await rpc(scope, receive, send)
        else:
            await plain(scope, receive, send)

    return app
