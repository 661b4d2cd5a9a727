"""The extension routes called with an E2B SDK's connection settings (`ConnectionConfig`), and
their errors raised as the SDK raises those of its own routes."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx
from e2b import AsyncSandbox, ConnectionConfig, Sandbox
from e2b.api import handle_api_exception
from e2b.exceptions import NotFoundException

from aenv.api.reset import PATH as RESET_PATH


def _request(config: ConnectionConfig, method: str, path: str, body: Any) -> dict[str, Any]:
    """What `_send` needs: the URL, headers (the API key as the SDK sends it) and timeout."""
    headers = {**config.headers}
    if config.api_key:
        headers["X-API-Key"] = config.api_key
    return {
        "method": method,
        "url": config.api_url.rstrip("/") + path,
        "headers": headers,
        "json": body,
        "timeout": config.get_request_timeout(),
    }


def _checked(response: httpx.Response) -> Any:
    if response.status_code == 404:  # the SDK's own routes say which thing is missing
        raise handle_api_exception(response, NotFoundException)
    if response.status_code >= 300:
        raise handle_api_exception(response)
    return response.json() if response.content else None


def _reset_call(sandbox_id: str, snapshot_id: str) -> tuple[str, dict[str, str]]:
    path = RESET_PATH.replace("{sandbox_id}", quote(sandbox_id, safe=""))
    return path, {"snapshotID": snapshot_id}


def reset(sandbox: Sandbox, snapshot_id: str) -> None:
    """Return `sandbox` to the state of snapshot (or template) `snapshot_id`, in place: its
    id, URLs and envd token stay, so `sandbox` goes on working. Raises the SDK's
    `NotFoundException` for an unknown sandbox or snapshot, `SandboxException` otherwise (the
    sandbox then runs on as it was)."""
    path, body = _reset_call(sandbox.sandbox_id, snapshot_id)
    request = _request(sandbox.connection_config, "POST", path, body)
    with httpx.Client(proxy=sandbox.connection_config.proxy) as client:
        _checked(client.request(**request))


async def reset_async(sandbox: AsyncSandbox, snapshot_id: str) -> None:
    """`reset` for an `AsyncSandbox`."""
    path, body = _reset_call(sandbox.sandbox_id, snapshot_id)
    request = _request(sandbox.connection_config, "POST", path, body)
    async with httpx.AsyncClient(proxy=sandbox.connection_config.proxy) as client:
        _checked(await client.request(**request))
