"""The envd ASGI application: Connect RPC services and plain HTTP routes behind one
access-token gate, on one port.

Around the services, as connect-go and infra's envd behave: CORS for browser clients, Basic-auth
users checked on every RPC, malformed JSON, gzip and envelopes answered as INVALID_ARGUMENT, and
no unexpected exception ever reaching the server (which would drop the keep-alive connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from connectrpc.code import Code
from connectrpc.codec import Codec, proto_binary_codec, proto_json_codec
from connectrpc.compression import Compression
from connectrpc.compression.gzip import GzipCompression
from connectrpc.errors import ConnectError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aenv.envd.auth import TOKEN_HEADER, UNAUTHORIZED_MESSAGE, route_needs_token, tokens_equal
from aenv.envd.filesystem.service import FilesystemService
from aenv.envd.http import copy, files, system
from aenv.envd.process import reaper
from aenv.envd.process.service import ProcessService
from aenv.envd.process.table import ProcessTable
from aenv.envd.proto.filesystem.filesystem_connect import FilesystemASGIApplication
from aenv.envd.proto.process.process_connect import ProcessASGIApplication
from aenv.envd.settings import Settings
from aenv.envd.users import UnknownUserError, User, username_from_basic_auth

log = logging.getLogger(__name__)


async def _unauthorized(send: Send) -> None:
    body = json.dumps({"code": 401, "message": UNAUTHORIZED_MESSAGE}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class _StrictCodec:
    """A codec whose decoding failures are INVALID_ARGUMENT errors (as in connect-go), not
    arbitrary exceptions that connectrpc reports as UNKNOWN and then re-raises."""

    def __init__(self, inner: Codec[Any, Any]) -> None:
        self._inner = inner

    def name(self) -> str:
        return self._inner.name()

    def encode(self, message: Any) -> bytes:
        return self._inner.encode(message)

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self._inner.decode(data, message_class)
        except ConnectError:
            raise
        except Exception as e:
            raise ConnectError(
                Code.INVALID_ARGUMENT, f"unmarshal into {message_class.__name__}: {e}"
            ) from e


class _StrictGzip:
    """gzip whose undecodable input is INVALID_ARGUMENT, not an arbitrary exception."""

    def __init__(self) -> None:
        self._inner = GzipCompression()

    def name(self) -> str:
        return self._inner.name()

    def compress(self, data: bytes | bytearray | memoryview) -> bytes:
        return self._inner.compress(data)

    def decompress(
        self, data: bytes | bytearray | memoryview, read_max_bytes: int | None = None
    ) -> bytes:
        try:
            return self._inner.decompress(data, read_max_bytes)
        except ConnectError:
            raise
        except Exception as e:
            raise ConnectError(Code.INVALID_ARGUMENT, f"decompress: {e}") from e


_COMPRESSIONS: list[Compression] = [_StrictGzip()]

_CODECS: list[Codec[Any, Any]] = [
    _StrictCodec(proto_binary_codec()),
    _StrictCodec(proto_json_codec()),
]


async def _connect_error(scope: Scope, send: Send, code: Code, status: int, message: str) -> None:
    """A Connect error before the RPC runs: an end-of-stream frame for streaming requests, a
    JSON error body with the code's HTTP status for unary ones."""
    error = {"code": code.value, "message": message}
    content_type = _header(scope, b"content-type") or ""
    if content_type.startswith("application/connect+"):
        payload = json.dumps({"error": error}).encode()
        body = struct.pack(">BI", 2, len(payload)) + payload
        status, content_type = 200, content_type
    else:
        body, content_type = json.dumps(error).encode(), "application/json"
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type.encode()),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


# Largest RPC request message. connect-go (infra) has no limit and connectrpc's default is 4 MiB,
# which a `send_stdin` of a few MB or a command with a large inline script would exceed.
MAX_REQUEST_BYTES = 256 * 1024 * 1024


def _envelope_error(body: bytes) -> str | None:
    """What is wrong with the framing of a streaming request body, or None if it is whole."""
    offset = 0
    while offset < len(body):
        if len(body) - offset < 5:
            return f"protocol error: incomplete envelope: {len(body) - offset} bytes, need 5"
        (length,) = struct.unpack_from(">I", body, offset + 1)
        got = len(body) - offset - 5
        if got < length:
            return f"protocol error: promised {length} bytes in enveloped message, got {got} bytes"
        offset += 5 + length
    return None


async def _with_checked_envelopes(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Read a server-streaming request's body whole and reject broken framing with
    INVALID_ARGUMENT (connectrpc would silently drop a truncated envelope and answer "zero
    messages"); then run `app` with the body replayed."""
    if not (_header(scope, b"content-type") or "").startswith("application/connect+"):
        await app(scope, receive, send)  # not Connect streaming framing: connectrpc answers 415
        return
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return  # the client left before sending its request
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_REQUEST_BYTES + 5:
            await _connect_error(
                scope, send, Code.RESOURCE_EXHAUSTED, 429, "request message is too large"
            )
            return
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    if (problem := _envelope_error(body)) is not None:
        await _connect_error(scope, send, Code.INVALID_ARGUMENT, 400, problem)
        return
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    await app(scope, replay, send)


def _grpc_without_trailers(scope: Scope) -> bool:
    """A gRPC (not gRPC-Web) request on a server that cannot send HTTP trailers, which gRPC
    needs for its status: connectrpc would answer it with a bare 500."""
    content_type = _header(scope, b"content-type") or ""
    return (
        content_type.startswith("application/grpc")
        and not content_type.startswith("application/grpc-web")
        and "http.response.trailers" not in scope.get("extensions", {})
    )


def _unknown_rpc_user(scope: Scope) -> str | None:
    """The error for a Basic-auth user that does not exist (checked for every RPC, as infra's
    authn middleware does), or None."""
    name = username_from_basic_auth(_header(scope, b"authorization"))
    if name is None:
        return None
    try:
        User.lookup(name)
    except UnknownUserError as e:
        return str(e)
    return None


async def _guarded(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Run `app`, keeping an unexpected exception from reaching the server: connectrpc and
    Starlette have already answered with an error by then, and a re-raised exception would make
    uvicorn drop the keep-alive connection under the client's next request."""
    try:
        await app(scope, receive, send)
    except Exception:
        log.exception("unhandled error serving %s %s", scope.get("method"), scope.get("path"))


async def _http_error(_: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, method not allowed) as JSON errors."""
    assert isinstance(exc, HTTPException)
    return JSONResponse(
        {"code": exc.status_code, "message": exc.detail},
        status_code=exc.status_code,
        headers=exc.headers,
    )


async def _internal_error(_: Request, exc: Exception) -> Response:
    return JSONResponse({"code": 500, "message": f"internal error: {exc}"}, status_code=500)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


# Server-streaming methods: a client may leave while the handler waits for the next event.
_STREAMS = frozenset(
    {"/process.Process/Start", "/process.Process/Connect", "/filesystem.Filesystem/WatchDir"}
)


async def _serve_stream(rpc: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Run a streaming RPC and cancel it as soon as its client disconnects.

    connectrpc notices a disconnect only when the handler yields its next message, which for an
    idle watch is up to a keepalive interval later; cancelling at once releases the watch (or
    the process subscription) now. The process itself is never touched by this.
    """
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watched_receive() -> Message:
        nonlocal gone
        message = await receive()
        if message["type"] == "http.disconnect" and not gone:
            gone = True
            task.cancel()
        return message

    try:
        await rpc(scope, watched_receive, send)
    except (asyncio.CancelledError, ConnectError):
        if not gone:
            raise
    finally:
        if gone:
            task.uncancel()


# CORS as infra's envd configures it (rs/cors + connectrpc.com/cors), so the JS SDK works from
# a browser: any origin, preflights answered before the access-token check.
CORS_MAX_AGE_SECONDS = 2 * 60 * 60
_CORS_METHODS = frozenset({"HEAD", "GET", "POST", "PUT", "PATCH", "DELETE"})
_CORS_EXPOSED = (
    b"Grpc-Status, Grpc-Message, Grpc-Status-Details-Bin, Location, Cache-Control, "
    b"X-Content-Type-Options"
)


def with_cors(app: ASGIApp) -> ASGIApp:
    async def cors(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _header(scope, b"origin") is None:
            await app(scope, receive, send)
            return
        requested = _header(scope, b"access-control-request-method")
        if scope["method"] == "OPTIONS" and requested is not None:
            headers = [
                (b"vary", b"Origin, Access-Control-Request-Method, Access-Control-Request-Headers"),
                (b"content-length", b"0"),
            ]
            if requested.upper() in _CORS_METHODS:
                headers += [
                    (b"access-control-allow-origin", b"*"),
                    (b"access-control-allow-methods", requested.upper().encode()),
                    (b"access-control-max-age", str(CORS_MAX_AGE_SECONDS).encode()),
                ]
                if asked := _header(scope, b"access-control-request-headers"):
                    headers.append((b"access-control-allow-headers", asked.encode("latin-1")))
            await send({"type": "http.response.start", "status": 204, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    *message.get("headers", []),
                    (b"vary", b"Origin"),
                    (b"access-control-allow-origin", b"*"),
                    (b"access-control-expose-headers", _CORS_EXPOSED),
                ]
                message = {**message, "headers": headers}
            await send(message)

        await app(scope, receive, send_with_cors)

    return cors


def create_app(settings: Settings) -> ASGIApp:
    table = ProcessTable(settings.process_retention)
    filesystem = FilesystemService(settings)
    rpc_apps: dict[str, ASGIApp] = {
        "/process.Process/": ProcessASGIApplication(
            ProcessService(settings, table),
            codecs=_CODECS,
            compressions=_COMPRESSIONS,
            read_max_bytes=MAX_REQUEST_BYTES,
        ),
        "/filesystem.Filesystem/": FilesystemASGIApplication(
            filesystem,
            codecs=_CODECS,
            compressions=_COMPRESSIONS,
            read_max_bytes=MAX_REQUEST_BYTES,
        ),
    }
    sampler = system.CPUSampler()

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        reaper.install_if_init(asyncio.get_running_loop())
        yield
        await filesystem.close()
        table.kill_all()

    http = Starlette(
        routes=[
            Route("/health", system.health, methods=["GET"]),
            Route("/init", partial(system.init, settings=settings), methods=["POST"]),
            Route("/envs", partial(system.envs, settings=settings), methods=["GET"]),
            Route("/sync", system.sync, methods=["POST"]),
            Route("/metrics", partial(system.metrics, sampler=sampler), methods=["GET"]),
            Route("/files", partial(files.download, settings=settings), methods=["GET"]),
            Route("/files", partial(files.upload, settings=settings), methods=["POST"]),
            Route("/aenv/copy", copy.copy, methods=["POST"]),
            Route("/aenv/volumes/release", system.release_volumes, methods=["POST"]),
            Route("/aenv/volumes/mount", system.mount_volumes, methods=["POST"]),
            Route(
                "/aenv/egress-ca", partial(system.egress_ca, settings=settings), methods=["POST"]
            ),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
    )
    token_header = TOKEN_HEADER.encode()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await http(scope, receive, send)
            return
        path: str = scope["path"]
        token = settings.access_token
        if (
            token is not None
            and route_needs_token(scope["method"], path)
            and not tokens_equal(token, _header(scope, token_header))
        ):
            await _unauthorized(send)
            return
        for prefix, rpc in rpc_apps.items():
            if path.startswith(prefix):
                if _grpc_without_trailers(scope):
                    await _connect_error(
                        scope,
                        send,
                        Code.UNIMPLEMENTED,
                        415,
                        "gRPC needs HTTP/2 trailers: use the Connect or gRPC-Web protocol",
                    )
                elif (bad_user := _unknown_rpc_user(scope)) is not None:
                    await _connect_error(scope, send, Code.UNAUTHENTICATED, 401, bad_user)
                elif path in _STREAMS:
                    stream = partial(_with_checked_envelopes, partial(_serve_stream, rpc))
                    await _guarded(stream, scope, receive, send)
                else:
                    await _guarded(rpc, scope, receive, send)
                return
        await _guarded(http, scope, receive, send)

    return with_cors(app)
