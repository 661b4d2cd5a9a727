"""Webhooks across a cluster: E2B's `/events/webhooks` routes, as one node answers them, over the
cluster's set in Redis (`aenv.cluster.webhooks`), which every node mirrors and delivers from.

A URL is checked for its scheme and host here; whether its address is one a sandbox could reach
is each node's judgement at delivery (its settings, `webhook_internal_allowed`), so a refused
target shows as failed deliveries in the log, not as a 400. The delivery log
(`/events/webhooks/{id}/deliveries`) is each live node's, merged newest first. An update or a
delete through two gateways at once is applied whole or not at all (`ClusterWebhooks`: compare
and set), never one undoing the other.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError, not_found
from aenv.api.models import NewWebhook, WebhookChanges
from aenv.api.requests import check_query, parse_body, query_int
from aenv.api.scope import team_of
from aenv.api.webhooks import MAX_LOG, changes_of, delivery_states, webhook_json
from aenv.cluster.directory import Directory
from aenv.cluster.registry import NodeReport
from aenv.cluster.webhooks import ClusterWebhooks
from aenv.gateway.nodes import NodeUnreachable, message
from aenv.gateway.saved import NodeCall
from aenv.orchestrator.webhook_delivery import parse_url
from aenv.orchestrator.webhooks import Webhook, new_webhook


def _check_url(url: str) -> None:
    try:
        parse_url(url)
    except ValueError as e:
        raise APIError(400, f"url: {e}") from e


class WebhookRoutes:
    def __init__(self, directory: Directory, call: NodeCall) -> None:
        self.hooks = ClusterWebhooks(directory.client, directory.registry.keys)
        self.directory = directory
        self.call = call

    def routes(self) -> list[Route]:
        one = "/events/webhooks/{webhook_id}"
        return [
            Route("/events/webhooks", self.create, methods=["POST"]),
            Route("/events/webhooks", self.listed, methods=["GET"]),
            Route(one, self.get, methods=["GET"]),
            Route(one, self.update, methods=["PATCH"]),
            Route(one, self.delete, methods=["DELETE"]),
            Route(one + "/deliveries", self.deliveries, methods=["GET"]),
        ]

    async def _get(self, request: Request) -> Webhook:
        webhook_id = request.path_params["webhook_id"]
        hook = await self.hooks.get(team_of(request), webhook_id)
        if hook is None:
            raise not_found(f"webhook '{webhook_id}'")
        return hook

    async def create(self, request: Request) -> Response:
        check_query(request)
        body = await parse_body(request, NewWebhook)
        _check_url(body.url)
        hook = new_webhook(
            team_of(request), body.name, body.url, body.enabled, body.events, body.signature_secret
        )
        await self.hooks.put(hook)
        return JSONResponse(webhook_json(hook), status_code=201)

    async def listed(self, request: Request) -> Response:
        check_query(request)
        hooks = [h for h in await self.hooks.all() if h.team_id == team_of(request)]
        return JSONResponse([webhook_json(h) for h in hooks])

    async def get(self, request: Request) -> Response:
        check_query(request)
        return JSONResponse(webhook_json(await self._get(request)))

    async def update(self, request: Request) -> Response:
        check_query(request)
        hook = await self._get(request)
        body = await parse_body(request, WebhookChanges)
        if body.url is not None:
            _check_url(body.url)
        updated = await self.hooks.update(team_of(request), hook.id, changes_of(body))
        if updated is None:  # deleted meanwhile, through another gateway
            raise not_found(f"webhook '{hook.id}'")
        return JSONResponse(webhook_json(updated))

    async def delete(self, request: Request) -> Response:
        check_query(request)
        hook = await self._get(request)
        if not await self.hooks.delete(team_of(request), hook.id):
            raise not_found(f"webhook '{hook.id}'")
        return Response(status_code=200)

    async def deliveries(self, request: Request) -> Response:
        check_query(request, ("limit", "state"))
        hook = await self._get(request)
        limit = query_int(request, "limit", 100, 1, MAX_LOG)
        params = [("limit", str(limit)), *(("state", s.value) for s in delivery_states(request))]
        target = f"/events/webhooks/{hook.id}/deliveries?{urlencode(params)}"
        nodes = await self.directory.live()
        logs = await asyncio.gather(*(self._log(request, n, target) for n in nodes))
        merged = sorted((d for log in logs for d in log), key=lambda d: d["createdAt"])
        return JSONResponse(merged[::-1][:limit])

    async def _log(self, request: Request, node: NodeReport, target: str) -> list[Any]:
        """A node's log of the webhook; empty when the node has not mirrored it yet."""
        try:
            answer = await self.call(request, node, "GET", target, b"")
        except NodeUnreachable as error:
            raise APIError(502, str(error)) from error
        if answer.status == 404:
            return []
        if answer.status != 200:
            raise APIError(answer.status, message(answer))
        return list(json.loads(answer.body))
