"""A volume's files on its page: browse its directories and download a file, through E2B's
volume content API (`/volumecontent/{volumeID}/...`) of the node or gateway, with the volume's
token, which the API gives the session's key (`GET /volumes/{volumeID}`); so a session sees
exactly the volumes its key may, on a node and across a cluster alike.

A download is read whole from the in-process API before it is sent (its transport holds an
answer's body), so it is bounded (`DOWNLOAD_MAX`): a larger file is refused with a 413 naming
the SDKs' `Volume.read_file`, which streams.
"""

from __future__ import annotations

import posixpath
from typing import Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import Response

from aenv.api.errors import APIError
from aenv.dashboard.listing import Entry, absolute, listing
from aenv.dashboard.pages import PREFIX, Pages
from aenv.dashboard.sessions import Session

DOWNLOAD_MAX = 64 << 20


class VolumeFilePages:
    def __init__(self, pages: Pages) -> None:
        self.pages = pages
        self.calls = pages.calls

    async def _content(
        self, session: Session, volume_id: str, route: str, path: str
    ) -> tuple[dict[str, Any], Any]:
        """The volume (as the session's key sees it), and the content API's answer to `GET
        route?path=`, made with the volume's token."""
        volume = await self.calls.json(session.key, f"/volumes/{quote(volume_id, safe='')}")
        answer = await self.calls.call(
            session.key,
            "GET",
            f"/volumecontent/{quote(volume_id, safe='')}/{route}",
            params={"path": path},
            headers={"Authorization": f"Bearer {volume['token']}"},
        )
        return volume, answer

    async def browse(self, request: Request, session: Session) -> Response:
        volume_id = request.path_params["volume_id"]
        path = absolute(request.query_params.get("path", "/"), "the volume")
        volume, answer = await self._content(session, volume_id, "dir", path)
        entries = (
            Entry(e["name"], e["path"], e["type"] == "directory", e.get("size", 0))
            for e in answer.json()
        )
        base = f"{PREFIX}/volumes/{quote(volume_id, safe='')}/files"
        return self.pages.render(
            request, "volume_files.html", session, volume=volume, **listing(path, entries, base)
        )

    async def download(self, request: Request, session: Session) -> Response:
        volume_id = request.path_params["volume_id"]
        path = absolute(request.query_params.get("path", ""), "the volume")
        _, stat = await self._content(session, volume_id, "path", path)
        size = stat.json().get("size", 0)
        if size > DOWNLOAD_MAX:
            raise APIError(
                413,
                f"{path} is {size} bytes: the dashboard downloads at most {DOWNLOAD_MAX}; "
                "read it with the SDKs' Volume.read_file",
            )
        _, answer = await self._content(session, volume_id, "file", path)
        name = quote(posixpath.basename(path) or "download")
        return Response(
            answer.content,
            media_type="application/octet-stream",
            headers={"Content-Disposition": f"attachment; filename*=UTF-8''{name}"},
        )
