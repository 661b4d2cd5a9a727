"""The control-plane ASGI app: routes, API-key check, JSON errors for everything."""

from __future__ import annotations

import asyncio
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from aenv.api.admin import AdminRoutes, open_admin_token
from aenv.api.api_keys import ApiKeyRoutes
from aenv.api.builds import BuildRoutes
from aenv.api.bulk import BulkRoutes
from aenv.api.chunks import ChunkRoutes
from aenv.api.errors import APIError
from aenv.api.events import EventRoutes
from aenv.api.extensions import ADMIN_PREFIXES, WAIT_HEADER
from aenv.api.handoff import HandoffRoutes
from aenv.api.identity import OPEN_PATHS as IDENTITY_PATHS
from aenv.api.identity import IdentityRoutes
from aenv.api.internal import caller, caller_key, record_refusal
from aenv.api.internal_models import Refusal
from aenv.api.keys import KeyBook, KeyStore, LocalKeys
from aenv.api.limits import RateLimiter, retry_after, seconds_of
from aenv.api.logs import LogRoutes
from aenv.api.metrics import NodeMetrics
from aenv.api.nodes import NodeRoutes
from aenv.api.openapi import PATH as OPENAPI_PATH
from aenv.api.openapi import OpenAPIDocument
from aenv.api.queue import QueueRoutes
from aenv.api.requests import check_query
from aenv.api.reset import ResetRoutes
from aenv.api.sandboxes import SandboxRoutes
from aenv.api.scope import TeamScope
from aenv.api.secrets import NodeSecrets, SecretRoutes
from aenv.api.snapshots import SnapshotRoutes
from aenv.api.teams import TeamRoutes
from aenv.api.templates import TemplateRoutes
from aenv.api.volume_content import PREFIX as CONTENT_PREFIX
from aenv.api.volumes import VolumeRoutes
from aenv.api.webhooks import WebhookRoutes
from aenv.config import Config
from aenv.orchestrator.build_egress import BuildEgress
from aenv.orchestrator.builds import Builder, ImageBooter
from aenv.orchestrator.lifecycle import Orchestrator
from aenv.orchestrator.memory_savers import MemorySavers
from aenv.orchestrator.tags import TagStore
from aenv.orchestrator.team_metrics import TeamMetrics
from aenv.orchestrator.teams import TeamStore

log = logging.getLogger("aenv.api")
# Health checks, Prometheus scrapes and the API description carry no secrets and usually no API
# key (E2B's spec declares the key scheme; reading it must not need one).
_OPEN_PATHS = frozenset({"/health", "/metrics", OPENAPI_PATH, *IDENTITY_PATHS})
_WAIT = WAIT_HEADER.lower().encode()


class APIKeyGate:
    """Every control-plane request but the `_OPEN_PATHS` carries one of the node's keys in
    `X-API-KEY` (or, from old SDKs, `Authorization: Bearer <key>`), within the key's rate limit
    (one sent with `X-Aenv-Wait` is held for its turn instead, see `api/limits.py`); the key it
    used is in the request's state (`api_key`). A call a cluster gateway made (see
    `api.internal`) was authenticated and rate-limited there: it acts as the key the gateway
    names."""

    def __init__(self, app: ASGIApp, keys: KeyBook, limiter: RateLimiter) -> None:
        self.app = app
        self.keys = keys
        self.limiter = limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        on_behalf = caller(scope.get("state", {}))
        path = scope.get("path", "")
        if on_behalf is not None:
            scope["state"]["api_key"] = caller_key(on_behalf)
        elif (
            scope["type"] == "http"
            and path not in _OPEN_PATHS
            and not path.startswith((CONTENT_PREFIX, *ADMIN_PREFIXES))
        ):
            headers = {k.lower(): v for k, v in scope["headers"]}
            given = headers.get(b"x-api-key", b"").decode("latin-1") or None
            bearer = headers.get(b"authorization", b"").decode("latin-1")
            if given is None and bearer.lower().startswith("bearer "):
                given = bearer[7:]
            key = await self.keys.find(given)
            if key is None:
                message = "Invalid API key" if given else "Missing API key: send X-API-KEY"
                await APIError(401, message).response()(scope, receive, send)
                return
            asked = seconds_of(headers.get(_WAIT, b"").decode("latin-1") or "0") or 0.0
            held = self.limiter.take(key.id, asked)
            if held is None:
                limited = APIError(
                    429, f"Rate limit exceeded: at most {self.limiter.rate:g} requests a second"
                ).response()
                limited.headers["Retry-After"] = retry_after(self.limiter.retry_in(key.id))
                await limited(scope, receive, send)
                return
            if held > 0:
                await asyncio.sleep(held)  # its turn in the key's rate (`api/limits.py`)
            scope.setdefault("state", {})["api_key"] = key
        await self.app(scope, receive, send)


async def _health(request: Request) -> Response:
    check_query(request)
    return Response(status_code=204)  # as E2B's spec has it


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    record_refusal(request.scope, exc.refusal)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    record_refusal(request.scope, Refusal.REJECTED)
    return APIError(exc.status_code, exc.detail or "error").response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    record_refusal(request.scope, Refusal.FAILED)
    return APIError(500, f"internal error: {type(exc).__name__}", should_retry=False).response()


# Every error a control plane answers, as `{"code", "message"}` JSON.
JSON_ERRORS = {APIError: _api_error, HTTPException: _http_error, Exception: _unexpected}


def node_builder(
    orchestrator: Orchestrator, config: Config, boot_image: ImageBooter | None = None
) -> Builder:
    """The node's template builder, as configured."""
    return Builder(
        orchestrator,
        TagStore(config.paths.template_tags),
        config.paths,
        config.build_ready_timeout,
        boot_image,
        cache_layers=config.build_cache_layers,
        egress=BuildEgress.for_node(
            config.build_egress, config.build_ca_bundle, config.debian_mirror
        ),
    )


def create_api(
    orchestrator: Orchestrator,
    config: Config,
    keys: KeyStore,
    builder: Builder | None = None,
    savers: MemorySavers | None = None,
) -> ASGIApp:
    book = LocalKeys(keys)
    metrics = NodeMetrics(orchestrator, savers)
    builder = builder or node_builder(orchestrator, config)
    teams = TeamStore(orchestrator.catalog)
    routes: list[BaseRoute] = [
        Route("/health", _health, methods=["GET"]),
        Route("/metrics", metrics.endpoint, methods=["GET"]),
        *SandboxRoutes(orchestrator, config, metrics, builder.unfinished).routes(),
        # Before the template routes: `/templates/tags` is not a template id.
        *BuildRoutes(builder).routes(),
        *TemplateRoutes(orchestrator, builder).routes(),
        *SnapshotRoutes(orchestrator, config).routes(),
        *ResetRoutes(orchestrator, config).routes(),
        *QueueRoutes(orchestrator, config).routes(),
        *BulkRoutes(orchestrator, config).routes(),
        *NodeRoutes(orchestrator).routes(),
        *LogRoutes(orchestrator).routes(),
        *ApiKeyRoutes(book).routes(),
        *VolumeRoutes(orchestrator).routes(),
        *EventRoutes(orchestrator.events).routes(),
        *WebhookRoutes(orchestrator.webhooks).routes(),
        *SecretRoutes(NodeSecrets(orchestrator.secrets)).routes(),
        *TeamRoutes(
            teams.named, TeamMetrics(orchestrator.catalog), config.events_retention_days * 86400
        ).routes(),
    ]
    routes = TeamScope(orchestrator, config.team_creates_per_s, config.create_max_wait).guard(
        routes
    )
    digest = open_admin_token(config.paths.admin_token)
    routes += AdminRoutes(orchestrator, builder, keys, teams, digest).routes()
    # Last: it describes every route above.
    routes.append(OpenAPIDocument(routes, _OPEN_PATHS).route)
    # Not described: no client can call them, only a cluster's gateways (`api.handoff`).
    routes += HandoffRoutes(orchestrator, builder.tags).routes()
    routes += ChunkRoutes(orchestrator.saved.archive).routes()
    # Not E2B's API but OIDC's: the keys workload identity tokens verify with.
    if orchestrator.signer is not None:
        routes += IdentityRoutes(orchestrator.signer).routes()
    app = Starlette(routes=routes, exception_handlers=JSON_ERRORS)
    limiter = RateLimiter(
        config.key_requests_per_s, config.key_request_burst, config.create_max_wait
    )
    return APIKeyGate(app, book, limiter)
