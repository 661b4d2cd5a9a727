"""Moving a paused sandbox between the nodes of a cluster, for gateways only: `release` gives a
sandbox up (paused first, its checkpoint in the shared repository), `adopt` takes one another
node released or lost (see docs/cluster.md, "State follows the sandbox"); `adopt_template` takes a
snapshot or built template another node made, stored in the shared repository, so sandboxes
start from it here, with the tags its holders gave it.

The routes answer only calls a gateway made through the internal API (`api.internal`): to a
user's key they do not exist (404), so no client can move or inject sandboxes.

Deprecated as routes a gateway calls directly (`/internal/cluster/...`, version 0 of the
internal API, kept for the gateways of the previous release): a gateway of this release calls
them as the version 1 operations `release` and `adopt/{kind}` (`api.internal_models`).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from aenv.api.errors import APIError, call_lifecycle
from aenv.api.internal import gateway_only
from aenv.api.internal_models import ADOPT_ROUTES, SANDBOX_ROUTES, AdoptKind, SandboxOp
from aenv.orchestrator.catalog import record_from_json, record_to_json
from aenv.orchestrator.lifecycle import OperationFailed, Orchestrator
from aenv.orchestrator.tags import TagStore, without_tags
from aenv.orchestrator.templates import template_from_json, template_to_json

RELEASE = SANDBOX_ROUTES[SandboxOp.RELEASE][1].replace("{id}", "{sandbox_id}")
ADOPT = ADOPT_ROUTES[AdoptKind.SANDBOX]
ADOPT_TEMPLATE = ADOPT_ROUTES[AdoptKind.TEMPLATE]
RECORD_TYPE = "application/json"


class HandoffRoutes:
    def __init__(self, orchestrator: Orchestrator, tags: TagStore | None = None) -> None:
        self.orc = orchestrator
        self.tags = tags

    def routes(self) -> list[Route]:
        return [
            Route(RELEASE, self.release, methods=["POST"]),
            Route(ADOPT, self.adopt, methods=["POST"]),
            Route(ADOPT_TEMPLATE, self.adopt_template, methods=["POST"]),
        ]

    async def release(self, request: Request) -> Response:
        """The released sandbox's record (`catalog.record_to_json`), 409 when it cannot move."""
        gateway_only(request)
        sandbox_id = request.path_params["sandbox_id"]
        record = await call_lifecycle(self.orc.release(sandbox_id), sandbox_id)
        return Response(record_to_json(record), media_type=RECORD_TYPE)

    async def adopt(self, request: Request) -> Response:
        """Takes the record in the body; answers it as adopted (or as already held here)."""
        gateway_only(request)
        try:
            record = record_from_json((await request.body()).decode())
        except (ValueError, KeyError, TypeError) as e:
            raise APIError(400, f"not a sandbox record: {e!r}") from e
        adopted = await call_lifecycle(self.orc.adopt(record), record.id)
        return Response(record_to_json(adopted), media_type=RECORD_TYPE)

    async def adopt_template(self, request: Request) -> Response:
        """Takes the template record with its tags (`tags.with_tags`) in the body; answers it
        as recorded here (the tags kept beside it). 409 when it cannot be (no repository, no
        stored copy)."""
        gateway_only(request)
        try:
            record, builds = without_tags((await request.body()).decode())
            template = template_from_json(record)
        except (ValueError, KeyError, TypeError) as e:
            raise APIError(400, f"not a template record: {e!r}") from e
        try:
            adopted = await self.orc.adopt_template(template)
        except OperationFailed as e:
            raise APIError(409, str(e)) from e
        if self.tags is not None and builds:
            self.tags.take(adopted.template_id, builds)
        return Response(template_to_json(adopted), media_type=RECORD_TYPE)
