"""The pages of what outlives a sandbox: snapshots (start a sandbox from one, delete one) and
volumes (create, delete). Through the API's `/snapshots`, `/sandboxes`, `/templates` and
`/volumes` routes with the session's key."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from aenv.api.errors import APIError
from aenv.dashboard.pages import PREFIX, Pages
from aenv.dashboard.sessions import Session


class SavedPages:
    def __init__(self, pages: Pages) -> None:
        self.pages = pages
        self.calls = pages.calls

    async def snapshots(self, request: Request, session: Session) -> Response:
        listed = await self.calls.json(session.key, "/snapshots")
        return self.pages.render(request, "snapshots.html", session, snapshots=listed)

    async def snapshot_action(self, request: Request, session: Session) -> Response:
        snapshot_id = request.path_params["snapshot_id"]
        match request.path_params["action"]:
            case "start":
                body = {"templateID": snapshot_id}
                created = await self.calls.call(session.key, "POST", "/sandboxes", json=body)
                started = created.json()["sandboxID"]
                return RedirectResponse(f"{PREFIX}/sandboxes/{started}", status_code=303)
            case "delete":
                await self.calls.call(session.key, "DELETE", f"/templates/{snapshot_id}")
            case action:
                raise APIError(404, f"no action '{action}'")
        return RedirectResponse(PREFIX + "/snapshots", status_code=303)

    async def volumes(self, request: Request, session: Session) -> Response:
        listed = await self.calls.json(session.key, "/volumes")
        return self.pages.render(request, "volumes.html", session, volumes=listed)

    async def create_volume(self, request: Request, session: Session) -> Response:
        name = (await request.form()).get("name")
        if not isinstance(name, str):
            raise APIError(400, "name: required")
        await self.calls.call(session.key, "POST", "/volumes", json={"name": name})
        return RedirectResponse(PREFIX + "/volumes", status_code=303)

    async def delete_volume(self, request: Request, session: Session) -> Response:
        volume_id = request.path_params["volume_id"]
        await self.calls.call(session.key, "DELETE", f"/volumes/{volume_id}")
        return RedirectResponse(PREFIX + "/volumes", status_code=303)
