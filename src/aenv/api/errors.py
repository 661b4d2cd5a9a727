"""JSON errors in the shape every E2B SDK parses: `{"code": <int>, "message": <str>}`."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

from starlette.responses import JSONResponse

from aenv.api.internal_models import Refusal
from aenv.orchestrator.lifecycle import InvalidState, OperationFailed, SandboxNotFound
from aenv.orchestrator.saved import refused

T = TypeVar("T")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_code: str | None = None,
        should_retry: bool | None = None,
        retry_after: int | None = None,
        refusal: Refusal = Refusal.REJECTED,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_code = error_code
        self.should_retry = should_retry
        self.retry_after = retry_after
        # What a gateway is told besides the E2B answer (`internal_models.NodeAnswer`): by
        # default, that the request is wrong wherever it goes.
        self.refusal = refusal

    def response(self) -> JSONResponse:
        body: dict[str, object] = {"code": self.status, "message": self.message}
        if self.error_code:
            body["error_code"] = self.error_code
        headers = {}
        if self.should_retry is not None:
            # The Python SDK retries 5xx unless told not to; a create that may have partly
            # happened must not be replayed blindly.
            headers["Should-Retry"] = "true" if self.should_retry else "false"
        if self.retry_after is not None:
            # Seconds: the Python SDK waits that long before it retries a 429 or 5xx.
            headers["Retry-After"] = str(self.retry_after)
        return JSONResponse(body, status_code=self.status, headers=headers)


def not_found(what: str) -> APIError:
    return APIError(404, f"{what} not found", refusal=Refusal.NOT_HERE)


async def call_lifecycle(operation: Awaitable[T], sandbox_id: str) -> T:
    """Run a pause/resume/snapshot/fork operation, turning its failures into the statuses the
    SDKs expect: 404 unknown, 409 wrong state (e.g. already paused), 422 a saved state it needs
    is corrupt or of a format this node cannot read (trying again cannot help), 500 failed (the
    sandbox is as it was, so the client may try again)."""
    try:
        return await operation
    except SandboxNotFound as e:
        raise not_found(f"sandbox '{sandbox_id}'") from e
    except InvalidState as e:
        raise APIError(409, str(e)) from e
    except OperationFailed as e:
        if refused(e.__cause__):
            raise APIError(422, str(e), should_retry=False, refusal=Refusal.FAILED) from e
        raise APIError(500, str(e), should_retry=False, refusal=Refusal.FAILED) from e
