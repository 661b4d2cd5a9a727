"""The reset-in-place route, an extension of the E2B API (under `/aenv/`, a prefix E2B's API
does not use): `POST /aenv/sandboxes/{id}/reset` returns a running sandbox to a snapshot's or
template's state, keeping its id, tokens, network and timeout (`orchestrator/reset.py`).

It answers 200 with E2B's `Sandbox` schema (what connect answers), so an SDK's sandbox object
stays valid: the id, URLs and envd token do not change. `aenv.sdk.reset` calls it with an E2B
SDK's connection settings.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError, call_lifecycle, not_found
from aenv.api.extensions import RESET
from aenv.api.internal_models import Refusal
from aenv.api.models import ResetBody
from aenv.api.requests import check_query, parse_body
from aenv.api.sandboxes import sandbox_body
from aenv.api.scope import team_of
from aenv.config import Config
from aenv.orchestrator.lifecycle import CapacityReached, Orchestrator
from aenv.orchestrator.templates import TemplateNotFound


class ResetRoutes:
    def __init__(self, orchestrator: Orchestrator, config: Config) -> None:
        self.orc = orchestrator
        self.config = config

    def routes(self) -> list[Route]:
        return [Route(RESET, self.reset, methods=["POST"])]

    async def reset(self, request: Request) -> Response:
        """200 reset; 404 unknown sandbox or snapshot; 409 not running; 429 no memory for the
        new VM beside the old; 500 failed (the sandbox runs on as it was)."""
        check_query(request)
        body = await parse_body(request, ResetBody)
        sandbox_id = request.path_params["sandbox_id"]
        if body.timeout is not None and body.timeout > self.config.max_timeout:
            raise APIError(400, f"timeout must be at most {self.config.max_timeout} seconds")
        try:
            # By id from here: another team's snapshot of the same name is not this one.
            source = self.orc.templates.get(body.snapshot_id, team_of(request)).template_id
            record = await call_lifecycle(self.orc.reset(sandbox_id, source), sandbox_id)
        except TemplateNotFound as e:
            raise not_found(f"snapshot '{body.snapshot_id}'") from e
        except CapacityReached as e:
            raise APIError(
                429, str(e), error_code="sandbox_capacity_unavailable", refusal=Refusal.FULL
            ) from e
        if body.timeout is not None:  # each episode may give the sandbox its time again
            record = self.orc.set_timeout(sandbox_id, body.timeout)
        return JSONResponse(sandbox_body(record, self.config))
