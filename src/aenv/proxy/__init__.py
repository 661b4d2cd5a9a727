"""Data plane: HTTP, streaming and WebSocket traffic to `<sandbox>:<port>`, addressed by E2B
headers, by host `{port}-{id}.{domain}` or by `/proxy/{id}/{port}/...` (see `app`)."""

from aenv.proxy.app import SandboxProxy
from aenv.proxy.resolver import (
    Resolver,
    SandboxNotFound,
    SandboxPaused,
    SandboxUnavailable,
    Upstream,
)
from aenv.proxy.routing import RoutingError, Target, route

__all__ = [
    "Resolver",
    "RoutingError",
    "SandboxNotFound",
    "SandboxPaused",
    "SandboxProxy",
    "SandboxUnavailable",
    "Target",
    "Upstream",
    "route",
]
