"""E2B's webhook routes: `/events/webhooks` (register, list) and `/events/webhooks/{webhookID}`
(get, update, delete), scoped to the caller's team; and this node's delivery log,
`GET /events/webhooks/{webhookID}/deliveries` (`limit`, `state`), newest first.

A webhook's secret is never answered. A URL that is not http(s), or whose host is a literal
address a sandbox could not reach, is refused with 400 (`webhook_delivery.check_url`); a
name is judged at each delivery."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError, not_found
from aenv.api.models import NewWebhook, WebhookChanges
from aenv.api.requests import check_query, parse_body, query_enums, query_int
from aenv.api.scope import team_of
from aenv.orchestrator.events import timestamp
from aenv.orchestrator.webhook_delivery import WebhookDispatcher, check_url
from aenv.orchestrator.webhooks import Delivery, DeliveryState, Webhook

MAX_LOG = 1000


def webhook_json(hook: Webhook) -> dict[str, Any]:
    """E2B's webhook as its docs show it answered: `teamId`, not the `teamID` of its other
    routes (e2b-dev/docs#197 corrected the docs' examples to the API's spelling)."""
    return {
        "id": hook.id,
        "teamId": hook.team_id,
        "name": hook.name,
        "createdAt": timestamp(hook.created_at),
        "enabled": hook.enabled,
        "url": hook.url,
        "events": list(hook.events),
    }


def delivery_json(delivery: Delivery) -> dict[str, Any]:
    return {
        "id": delivery.id,
        "eventID": delivery.event_id,
        "state": delivery.state.value,
        "attempts": delivery.attempts,
        "lastStatus": delivery.last_status,
        "lastError": delivery.last_error,
        "createdAt": timestamp(delivery.created_at),
        "updatedAt": timestamp(delivery.updated_at),
    }


def changes_of(body: WebhookChanges) -> dict[str, Any]:
    """A `PATCH`'s changes, by `Webhook` field."""
    given = (
        ("name", body.name),
        ("url", body.url),
        ("enabled", body.enabled),
        ("events", None if body.events is None else tuple(body.events)),
        ("secret", body.signature_secret),
    )
    return {name: value for name, value in given if value is not None}


def delivery_states(request: Request) -> tuple[DeliveryState, ...]:
    return query_enums(request, "state", DeliveryState, "states")


class WebhookRoutes:
    def __init__(self, dispatcher: WebhookDispatcher) -> None:
        self.dispatcher = dispatcher
        self.store = dispatcher.store

    def routes(self) -> list[Route]:
        one = "/events/webhooks/{webhook_id}"
        return [
            Route("/events/webhooks", self.create, methods=["POST"]),
            Route("/events/webhooks", self.list, methods=["GET"]),
            Route(one, self.get, methods=["GET"]),
            Route(one, self.update, methods=["PATCH"]),
            Route(one, self.delete, methods=["DELETE"]),
            Route(one + "/deliveries", self.deliveries, methods=["GET"]),
        ]

    def _check_url(self, url: str) -> None:
        try:
            check_url(url, self.dispatcher.settings)
        except ValueError as e:
            raise APIError(400, f"url: {e}") from e

    def _get(self, request: Request) -> Webhook:
        webhook_id = request.path_params["webhook_id"]
        hook = self.store.get(team_of(request), webhook_id)
        if hook is None:
            raise not_found(f"webhook '{webhook_id}'")
        return hook

    async def create(self, request: Request) -> Response:
        check_query(request)
        body = await parse_body(request, NewWebhook)
        self._check_url(body.url)
        hook = self.store.create(
            team_of(request), body.name, body.url, body.enabled, body.events, body.signature_secret
        )
        return JSONResponse(webhook_json(hook), status_code=201)

    async def list(self, request: Request) -> Response:
        check_query(request)
        return JSONResponse([webhook_json(h) for h in self.store.list(team_of(request))])

    async def get(self, request: Request) -> Response:
        check_query(request)
        return JSONResponse(webhook_json(self._get(request)))

    async def update(self, request: Request) -> Response:
        check_query(request)
        hook = self._get(request)
        body = await parse_body(request, WebhookChanges)
        if body.url is not None:
            self._check_url(body.url)
        updated = self.store.update(team_of(request), hook.id, **changes_of(body))
        if updated is None:
            raise not_found(f"webhook '{hook.id}'")
        self.dispatcher.wake()  # enabled again: its queue goes on
        return JSONResponse(webhook_json(updated))

    async def delete(self, request: Request) -> Response:
        check_query(request)
        hook = self._get(request)
        if not self.store.delete(team_of(request), hook.id):
            raise not_found(f"webhook '{hook.id}'")
        return Response(status_code=200)

    async def deliveries(self, request: Request) -> Response:
        check_query(request, ("limit", "state"))
        hook = self._get(request)
        log = self.store.log(
            team_of(request),
            hook.id,
            query_int(request, "limit", 100, 1, MAX_LOG),
            delivery_states(request),
        )
        return JSONResponse([delivery_json(d) for d in log])
