"""What a control-plane request carries, read strictly: its JSON body into a model, its query
against the names the route honours. Nothing a client sends is silently dropped: a field or
query parameter the route does not implement answers 400 naming it."""

from __future__ import annotations

from collections.abc import Collection
from enum import StrEnum
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from starlette.requests import Request

from aenv.api.errors import APIError

M = TypeVar("M", bound=BaseModel)
E = TypeVar("E", bound=StrEnum)
# Far above any valid body (metadata and env vars are bounded in models.py).
MAX_BODY = 1024 * 1024


def not_supported(field: str) -> APIError:
    return APIError(400, f"field '{field}' is not supported here")


async def _read_body(request: Request) -> bytes:
    """The body, refused with 413 past `MAX_BODY` before it is all in memory."""
    too_large = APIError(413, f"request body larger than {MAX_BODY} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _problem(err: ErrorDetails) -> str:
    where = ".".join(str(p) for p in err["loc"]) or "body"
    if err["type"] == "extra_forbidden":
        return f"field '{where}' is not supported here"
    return f"{where}: {err['msg']}"


async def parse_body(request: Request, model: type[M], *, optional: bool = False) -> M:
    raw = await _read_body(request)
    if not raw.strip() and optional:
        return model.model_validate({})
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        problems = "; ".join(_problem(err) for err in e.errors())
        raise APIError(400, f"invalid request body: {problems}") from e


def check_query(request: Request, honoured: Collection[str] = ()) -> None:
    """Refuse the query parameters outside `honoured`, naming them."""
    unknown = sorted(set(request.query_params) - set(honoured))
    if unknown:
        names = ", ".join(f"'{name}'" for name in unknown)
        raise APIError(400, f"query parameter {names} is not supported here")


def query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    """Integer query parameter `name` (`default` when absent), 400 outside [low, high]."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.lstrip("-").isdigit() or not low <= int(raw) <= high:
        raise APIError(400, f"query parameter '{name}' must be an integer from {low} to {high}")
    return int(raw)


def query_flag(request: Request, name: str, default: bool = False) -> bool:
    """Boolean query parameter `name`: `true` or `false`, 400 otherwise."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if raw.lower() not in ("true", "false"):
        raise APIError(400, f"query parameter '{name}' must be true or false")
    return raw.lower() == "true"


def query_enums(request: Request, name: str, kind: type[E], plural: str) -> tuple[E, ...]:
    """Repeated query parameter `name`, each a value of `kind`; 400 naming the known `plural`
    otherwise."""
    try:
        return tuple(kind(v) for v in request.query_params.getlist(name))
    except ValueError as e:
        known = ", ".join(k.value for k in kind)
        raise APIError(400, f"query parameter '{name}': {e}; the {plural} are {known}") from e
