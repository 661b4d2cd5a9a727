"""Helpers shared by the Connect RPC services: the caller's user, keepalive cadence, errors."""

from __future__ import annotations

import errno
from typing import Any, NoReturn

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext

from aenv.envd.settings import Settings
from aenv.envd.users import UnknownUserError, User, username_from_basic_auth

# envd's own default when the client sends no Keepalive-Ping-Interval (infra: 90 s).
DEFAULT_KEEPALIVE_SECONDS = 90.0


def caller(ctx: RequestContext[Any, Any], settings: Settings) -> User:
    """The user a request acts as: the Basic-auth name, else the sandbox default."""
    name = username_from_basic_auth(ctx.request_headers.get("authorization"))
    try:
        return User.lookup(name or settings.default_user)
    except UnknownUserError as e:
        if name is None:
            raise ConnectError(Code.UNAUTHENTICATED, f"invalid default user: '{e.name}'") from e
        raise ConnectError(Code.UNAUTHENTICATED, str(e)) from e


def keepalive_seconds(ctx: RequestContext[Any, Any]) -> float:
    raw = ctx.request_headers.get("keepalive-ping-interval")
    try:
        value = float(raw) if raw else DEFAULT_KEEPALIVE_SECONDS
    except ValueError:
        return DEFAULT_KEEPALIVE_SECONDS
    return value if value > 0 else DEFAULT_KEEPALIVE_SECONDS


_ERRNO_CODES = {
    errno.ENOENT: Code.NOT_FOUND,
    errno.ENOTDIR: Code.INVALID_ARGUMENT,
    errno.EISDIR: Code.INVALID_ARGUMENT,
    errno.EEXIST: Code.ALREADY_EXISTS,
    errno.ENOTEMPTY: Code.FAILED_PRECONDITION,
    errno.EACCES: Code.PERMISSION_DENIED,
    errno.EPERM: Code.PERMISSION_DENIED,
    errno.EROFS: Code.PERMISSION_DENIED,
    errno.ENOSPC: Code.RESOURCE_EXHAUSTED,
    errno.EDQUOT: Code.RESOURCE_EXHAUSTED,
    errno.ELOOP: Code.FAILED_PRECONDITION,
    errno.ENAMETOOLONG: Code.INVALID_ARGUMENT,
    errno.EXDEV: Code.FAILED_PRECONDITION,
    # rename(2) of a directory into itself, or of a mount point.
    errno.EINVAL: Code.INVALID_ARGUMENT,
    errno.EBUSY: Code.FAILED_PRECONDITION,
}


def os_error(e: OSError, what: str) -> NoReturn:
    """Re-raise an OSError as the Connect error the SDK maps correctly."""
    code = _ERRNO_CODES.get(e.errno or 0, Code.INTERNAL)
    detail = e.strerror or str(e)
    target = f" '{e.filename}'" if e.filename else ""
    raise ConnectError(code, f"{what}{target}: {detail}") from e
