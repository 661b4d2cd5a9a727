"""The API keys page: the keys (masked, as the API lists them), a new key shown once, and
revocation. Through E2B's `/api-keys` routes with the session's key: whoever holds a key may
manage the keys, on the dashboard as through the API. A session whose key is revoked ends at
its next request."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from aenv.api.errors import APIError
from aenv.dashboard.pages import PREFIX, Pages, seconds
from aenv.dashboard.sessions import Session


class KeyPages:
    def __init__(self, pages: Pages) -> None:
        self.pages = pages
        self.calls = pages.calls

    async def _page(
        self, request: Request, session: Session, created: dict[str, Any] | None = None
    ) -> Response:
        keys = [KeyRow(k) for k in await self.calls.json(session.key, "/api-keys")]
        return self.pages.render(
            request, "keys.html", session, keys=keys, created=created, now=time.time()
        )

    async def list(self, request: Request, session: Session) -> Response:
        return await self._page(request, session)

    async def create(self, request: Request, session: Session) -> Response:
        name = (await request.form()).get("name")
        if not isinstance(name, str):
            raise APIError(400, "name: required")
        answer = await self.calls.call(session.key, "POST", "/api-keys", json={"name": name})
        # Shown in this answer only (not stored, never cached): as the API, once.
        return await self._page(request, session, created=answer.json())

    async def revoke(self, request: Request, session: Session) -> Response:
        key_id = request.path_params["key_id"]
        await self.calls.call(session.key, "DELETE", f"/api-keys/{key_id}")
        return RedirectResponse(PREFIX + "/keys", status_code=303)


class KeyRow:
    def __init__(self, key: dict[str, Any]) -> None:
        mask = key["mask"]
        hidden = "…" if mask["valueLength"] > 6 else ""
        self.id: str = key["id"]
        self.name: str = key["name"]
        self.masked = f"{mask['prefix']}{mask['maskedValuePrefix']}{hidden}"
        self.masked += mask["maskedValueSuffix"]
        self.created = seconds(key["createdAt"])
        self.last_used = seconds(key["lastUsed"]) if key.get("lastUsed") else None
