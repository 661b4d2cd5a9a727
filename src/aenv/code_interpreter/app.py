"""The HTTP routes the SDKs call on port 49999, and their errors.

`POST /execute` streams NDJSON (`execution`); `/contexts` creates, lists, restarts and
removes contexts (`kernels`). Bad input gets a JSON `{"code", "message"}` error naming what
is wrong, and a field we do not know is refused rather than ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from aenv.code_interpreter import execution
from aenv.code_interpreter.kernel import warm_up
from aenv.code_interpreter.kernels import ContextNotFound, ContextTable, UnsupportedLanguage
from aenv.code_interpreter.languages import ENV_NAME
from aenv.code_interpreter.sandbox_env import SandboxEnv

Model = TypeVar("Model", bound=BaseModel)
Handler = Callable[[Request], Awaitable[Response]]


class ExecuteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str
    context_id: str | None = None
    language: str | None = None
    env_vars: dict[str, str] | None = None

    @field_validator("env_vars")
    @classmethod
    def _names(cls, env: dict[str, str] | None) -> dict[str, str] | None:
        bad = [name for name in env or {} if not ENV_NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"not an env var name: {bad[0]!r}")
        # No process environment can hold a NUL byte.
        if nul := [name for name, value in (env or {}).items() if "\0" in value]:
            raise ValueError(f"the value of {nul[0]!r} holds a NUL byte")
        return env


class CreateContextRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    language: str | None = None
    cwd: str | None = None


class HttpError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _error(code: int, message: str) -> JSONResponse:
    return JSONResponse({"code": code, "message": message}, status_code=code)


async def _body(request: Request, model: type[Model]) -> Model:
    try:
        raw: Any = json.loads(await request.body() or b"{}")
    except ValueError as e:
        raise HttpError(400, f"the body is not JSON: {e}") from e
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        if first["type"] == "extra_forbidden":
            raise HttpError(400, f"field {where!r} is not supported") from e
        raise HttpError(400, f"{where}: {first['msg']}") from e


def _guarded(handler: Handler) -> Handler:
    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except HttpError as e:
            return _error(e.code, e.message)
        except ContextNotFound as e:
            return _error(404, f"context {e.args[0]!r} not found")
        except UnsupportedLanguage as e:
            return _error(400, str(e))

    return guarded


async def _warm(table: ContextTable, language: str) -> None:
    """Start the language's default context and run its warm-up cell, if it is installed."""
    if language in table.languages:
        context = await table.default(language)
        if context.kind.warm_up:
            await warm_up(context.kernel.client, context.kind.warm_up)


def create_app(
    table: ContextTable, sandbox_env: SandboxEnv, default_languages: Sequence[str] = ("python",)
) -> Starlette:
    """`default_languages`: those whose default context starts with the server (all at once),
    so that a template saved with it running holds their kernels warm."""

    async def execute(request: Request) -> Response:
        body = await _body(request, ExecuteRequest)
        if body.context_id and body.language:
            raise HttpError(400, "give context_id or language, not both")
        if body.context_id:
            context = table.get(body.context_id)
        else:
            context = await table.default(body.language)
        if body.env_vars and context.kind.set_env is None:
            raise HttpError(400, f"env_vars: {context.language} cannot set env vars per execution")
        token = request.headers.get("X-Access-Token")
        stream = execution.run(context, body.code, body.env_vars or {}, sandbox_env, token)
        return StreamingResponse(stream, media_type="application/x-ndjson")

    async def list_contexts(request: Request) -> Response:
        return JSONResponse([c.to_json() for c in table.list()])

    async def create_context(request: Request) -> Response:
        body = await _body(request, CreateContextRequest)
        try:
            context = await table.create(body.language, body.cwd)
        except TimeoutError as e:  # an OSError too, but no fault of the request's
            raise HttpError(503, f"the kernel did not start in time ({e}); retry") from e
        except OSError as e:
            raise HttpError(400, f"cannot start a kernel in {body.cwd!r}: {e.strerror}") from e
        return JSONResponse(context.to_json())

    async def remove_context(request: Request) -> Response:
        await table.remove(request.path_params["context_id"])
        return Response(status_code=204)

    async def restart_context(request: Request) -> Response:
        await table.restart(request.path_params["context_id"])
        return Response(status_code=204)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # The default contexts, then a spare, start with the server: a template saved with the
        # server running holds them warm, and neither a first run_code nor the first
        # create_code_context waits for a kernel. A language not installed here has none.
        await asyncio.gather(*(_warm(table, name) for name in default_languages))
        table.spares.fill()
        await table.spares.ready()
        # What the first /execute would load lazily (anyio's asyncio backend, which streamed
        # responses run on; the thread pool envd is asked from): 0.1 s natively, seconds under
        # TCG, loaded before the template is saved.
        async with anyio.create_task_group():
            await asyncio.to_thread(int)
        try:
            yield
        finally:
            await execution.drain()
            await table.close()

    routes = [
        Route("/health", _guarded(health), methods=["GET"]),
        Route("/execute", _guarded(execute), methods=["POST"]),
        Route("/contexts", _guarded(list_contexts), methods=["GET"]),
        Route("/contexts", _guarded(create_context), methods=["POST"]),
        Route("/contexts/{context_id}", _guarded(remove_context), methods=["DELETE"]),
        Route("/contexts/{context_id}/restart", _guarded(restart_context), methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)
