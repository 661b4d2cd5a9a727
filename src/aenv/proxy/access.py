"""Who may reach what through the proxy: the checks made before connecting to a sandbox.

- envd's control routes (`POST /init`: token, clock, env vars) are for the orchestrator, which
  calls them at the slot address directly. envd exempts `/init` from its own token check, so
  through the proxy anyone could re-initialise a guest: refused here whatever the method, as in
  infra (`packages/orchestrator/pkg/sandbox/envd/internal_routes.go`).
- A sandbox created with a traffic access token (`allowPublicTraffic: false`) accepts traffic on
  its user ports only with that token in `e2b-traffic-access-token`. envd's port is exempt: envd
  checks its own access token (infra `packages/orchestrator/pkg/proxy/proxy.go`).
- Teams: the data plane takes no API key (a sandbox's envd access token and traffic token are
  what open it, and only its team is given them). A request that carries one anyway, in
  `X-API-Key` (an SDK or a client sending it to every URL), and whose key is another team's
  than the sandbox's, is answered exactly as a sandbox that does not exist, before the sandbox
  is looked up or resumed: no key opens another team's sandbox, whatever token comes with it.
  A value the node does not know as a key is no key (a service in a sandbox may take an
  `X-API-Key` of its own), and a sandbox's tokens need no key beside them, as in E2B. A key
  the node knows is taken out of the request: a guest is never handed one.
- A sandbox with `maskRequestHost` sees that host, `${PORT}` replaced by the port, instead of
  the one the client used, on its user ports (envd's too is exempt); the client's goes in
  `X-Forwarded-Host`, as infra's proxy does.
"""

from __future__ import annotations

import hmac
import posixpath
from typing import Protocol

from starlette.types import Scope

from aenv.envd import ENVD_PORT
from aenv.proxy.errors import (
    TRAFFIC_TOKEN_HEADER,
    internal_route,
    sandbox_not_found,
    traffic_token_invalid,
    traffic_token_missing,
)
from aenv.proxy.resolver import Upstream
from aenv.proxy.routing import Target

# envd's routes that only the orchestrator may call (src/aenv/envd/app.py). Add any new
# control route here.
ENVD_CONTROL_PATHS = frozenset({"/init"})

_TOKEN_HEADER = TRAFFIC_TOKEN_HEADER.encode()


def check_route(target: Target) -> None:
    """Raise the 404 `ProxyError` if `target` is an envd control route. Checked before the
    sandbox is looked up, so the answer says nothing about which sandboxes exist."""
    if target.port != ENVD_PORT:
        return
    # The decoded path, normalised, is a superset of what envd's router would match:
    # `/%69nit`, `//init`, `/files/../init` are refused too.
    clean = "/" + posixpath.normpath(target.path).lstrip("/")
    if clean in ENVD_CONTROL_PATHS:
        raise internal_route(target.path)


class Tenancy(Protocol):
    """Which team a request and a sandbox belong to (the node's keys and catalog)."""

    async def caller_team(self, scope: Scope) -> str | None:
        """The team of the API key the request carries (or that the cluster gateway which
        forwarded it checked); None when it carries none the node knows."""
        ...

    def sandbox_team(self, sandbox_id: str) -> str | None:
        """The sandbox's team; None when the node holds no such sandbox."""
        ...


async def check_team(target: Target, scope: Scope, tenancy: Tenancy) -> Scope:
    """Raise the not-found `ProxyError` if the request carries another team's API key; else
    the request to forward, without a key the node knows (the guest never sees one)."""
    team = await tenancy.caller_team(scope)
    if team is None:
        return scope
    owner = tenancy.sandbox_team(target.sandbox_id)
    if owner is not None and owner != team:
        raise sandbox_not_found(target.sandbox_id)
    return {**scope, "headers": [(n, v) for n, v in scope["headers"] if n != API_KEY_HEADER]}


# The header E2B's control plane takes an API key in, lower case as ASGI gives it.
API_KEY_HEADER = b"x-api-key"


def check_traffic_token(
    target: Target, upstream: Upstream, headers: list[tuple[bytes, bytes]]
) -> None:
    """Raise the 403 `ProxyError` if the sandbox requires a traffic token on this port and the
    request lacks it or carries another one."""
    expected = upstream.traffic_access_token
    if expected is None or target.port == ENVD_PORT:
        return
    given = next((value for name, value in headers if name == _TOKEN_HEADER), b"")
    if not given:
        raise traffic_token_missing(target.sandbox_id)
    if not hmac.compare_digest(given, expected.encode()):
        raise traffic_token_invalid(target.sandbox_id)


PORT_PLACEHOLDER = "${PORT}"


def request_host(target: Target, upstream: Upstream) -> str | None:
    """The `Host` the sandbox must see instead of the client's, or None to keep the client's."""
    mask = upstream.mask_request_host
    if mask is None or target.port == ENVD_PORT:
        return None
    return mask.replace(PORT_PLACEHOLDER, str(target.port))
