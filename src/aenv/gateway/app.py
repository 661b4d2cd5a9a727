"""The gateway's ASGI app: data-plane traffic (anything `aenv.proxy.routing` says names a
sandbox) to `dataplane`, `/dashboard` to the web dashboard, the rest to the control plane
(`control`) behind the gateway's API keys.

The gateway checks API keys and rate limits itself, from the cluster's keys in Redis
(`aenv.cluster.keys`), serves E2B's `/api-keys` routes over them, and calls nodes with the
cluster token and the id of the key it checked. Rate limits are counted by each gateway on its
own; a key's sandboxes at once across the cluster (`aenv.cluster.quota`). Redis not answering
a key check is a 503. The operator's routes (`aenv.gateway.admin`) take the cluster's admin
token instead of a key. Call `aclose()` when the server stops.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.types import Receive, Scope, Send

from aenv.api.api_keys import ApiKeyRoutes
from aenv.api.app import JSON_ERRORS, APIKeyGate
from aenv.api.identity import IdentityRoutes
from aenv.api.limits import RateLimiter
from aenv.api.teams import TeamRoutes
from aenv.cluster.directory import Directory
from aenv.cluster.keys import ClusterKeys
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.sessions import RedisSessions
from aenv.cluster.store import ClusterUnavailable
from aenv.cluster.teams import ClusterTeams
from aenv.config import Config
from aenv.dashboard.app import Dashboard
from aenv.gateway.admin import AdminRoutes
from aenv.gateway.cluster_nodes import ClusterNodeRoutes
from aenv.gateway.control import EXCEPTION_HANDLERS, ControlPlane
from aenv.gateway.dataplane import DataPlane
from aenv.gateway.handoff import Handoff
from aenv.gateway.nodes import NodeClient
from aenv.gateway.shells import NodeShells
from aenv.gateway.team_quota import DEFAULT_TEAM_LIMITS, TeamLimitSettings
from aenv.network.identity import Signer
from aenv.proxy.errors import ProxyError, bad_route, deny_websocket, send_http
from aenv.proxy.routing import RoutingError, route


class Gateway:
    def __init__(
        self,
        directory: Directory,
        secret: ClusterSecret,
        keys: ClusterKeys,
        limiter: RateLimiter,
        domain: str | None = None,
        key_max_sandboxes: int = Config().key_max_sandboxes,
        identity: Signer | None = None,
        team_max_sandboxes: int = Config().team_max_sandboxes,
        team_limits: TeamLimitSettings = DEFAULT_TEAM_LIMITS,
    ) -> None:
        """`identity`: the cluster's signer of workload identity tokens, whose keys the
        gateway publishes (`aenv.api.identity`); none: no route publishes any."""
        self.domain = domain
        self.nodes = NodeClient(secret)
        handoff = Handoff(directory, self.nodes)
        self.data = DataPlane(directory, secret, handoff, keys=keys)
        control = ControlPlane(
            directory, self.nodes, handoff, key_max_sandboxes, team_max_sandboxes, team_limits
        )
        published = IdentityRoutes(identity).routes() if identity is not None else []
        teams = ClusterTeams(directory.client, directory.registry.keys)
        app = Starlette(
            routes=[
                *published,
                *ApiKeyRoutes(keys).routes(),
                *TeamRoutes(teams.named).routes(),
                *AdminRoutes(control, keys, teams, secret).routes(),
                *ClusterNodeRoutes(directory, self.nodes).routes(),
                *control.routes(),
            ],
            exception_handlers={**EXCEPTION_HANDLERS, **JSON_ERRORS},
        )
        # The dashboard over the gateway's API: the cluster's sandboxes and templates, and
        # terminals and files through the node that runs the sandbox (`shells`).
        self.shells = NodeShells(directory, self.nodes, secret)
        # Its sessions are the cluster's (in Redis, sealed), so any gateway serves them.
        self.control = Dashboard(
            APIKeyGate(app, keys, limiter),
            self.shells,
            sessions=RedisSessions(directory.client, secret, directory.registry.keys),
            cluster=True,
        )

    async def aclose(self) -> None:
        await self.nodes.aclose()
        await self.data.aclose()
        await self.shells.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return
        try:
            target = route(scope, self.domain)
            if target is None:
                await self.control(scope, receive, send)
            else:
                await self.data.serve(target, scope, receive, send)
        except RoutingError as error:
            await _answer(bad_route(error.message), scope, send)
        except ProxyError as error:
            await _answer(error, scope, send)
        except ClusterUnavailable as error:
            # From the key check, which runs before the control plane's own error handlers.
            await _answer(
                ProxyError(503, {"code": 503, "message": f"the cluster is unavailable: {error}"}),
                scope,
                send,
            )


async def _answer(error: ProxyError, scope: Scope, send: Send) -> None:
    if scope["type"] == "websocket":
        await deny_websocket(error, scope, send)
    else:
        await send_http(error, send)
