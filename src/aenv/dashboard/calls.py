"""The dashboard's one way to read or change anything: the node's (or gateway's) API app,
called in-process with a session's API key, through the same key gate, rate limit, routes and
checks an SDK meets. The dashboard holds no permission model of its own."""

from __future__ import annotations

from typing import Any

import httpx
from starlette.types import ASGIApp


class KeyRefused(Exception):
    """The API refused the session's key (revoked, or never valid): the session is over."""


class ApiRefused(Exception):
    """The API answered an error: its status and its message, as an SDK would see them."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class ApiCalls:
    def __init__(self, api: ASGIApp) -> None:
        # In-process: the request never leaves the serving process, and the API sees it as it
        # sees any client's. The transport holds no connection (nothing to close) and
        # applies no timeout (a pause under TCG takes what it takes).
        self._client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=api), base_url="http://api"
        )

    async def call(self, key: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """`method path` as the holder of `key`: the answer when it is a success, else
        `KeyRefused` (401) or `ApiRefused` (any other error)."""
        headers = {**kwargs.pop("headers", {}), "X-API-KEY": key}
        response = await self._client.request(method, path, headers=headers, **kwargs)
        if response.status_code == 401:
            raise KeyRefused()
        if not response.is_success:
            try:
                message = str(response.json()["message"])
            except (ValueError, KeyError, TypeError):
                message = response.text
            raise ApiRefused(response.status_code, message)
        return response

    async def json(self, key: str, path: str, **params: str) -> Any:
        """The JSON body of `GET path?params`."""
        return (await self.call(key, "GET", path, params=params)).json()
