"""A sandbox's files on its page: browse a directory, download a file, upload one, as the
sandbox's default user (`terminal.USER`), through the node's `EnvdClient` (envd's filesystem
service and `/files`), for a session whose key may see the sandbox through the API."""

from __future__ import annotations

import contextlib
import posixpath
from collections.abc import AsyncIterator
from urllib.parse import quote, urlencode

import pyqwest
from connectrpc.errors import ConnectError
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse

from aenv.api.errors import APIError
from aenv.dashboard.listing import Entry, absolute, listing
from aenv.dashboard.pages import PREFIX, Pages
from aenv.dashboard.sessions import Session
from aenv.dashboard.terminal import USER, SandboxShells
from aenv.envd.proto.filesystem import filesystem_pb as fs
from aenv.envd.proto.filesystem.filesystem_connect import FilesystemClient
from aenv.orchestrator.envd_client import EnvdClient, EnvdRefused, EnvdUnavailable, rpc_transport

HOME = "/home/user"


class FilePages:
    def __init__(self, pages: Pages, shells: SandboxShells | None) -> None:
        self.pages = pages
        self.calls = pages.calls
        self.shells = shells

    async def _envd(self, request: Request, session: Session) -> EnvdClient:
        """The sandbox's envd, once the API said the session's key may see the sandbox."""
        sandbox_id = request.path_params["sandbox_id"]
        await self.calls.call(session.key, "GET", f"/sandboxes/{sandbox_id}")
        if self.shells is None:
            raise APIError(501, "files are a node's: this server has no sandboxes of its own")
        try:
            return await self.shells.envd(sandbox_id)
        except LookupError as e:
            raise APIError(409, "the sandbox is not running") from e

    async def browse(self, request: Request, session: Session) -> Response:
        path = absolute(request.query_params.get("path", HOME), "the sandbox")
        envd = await self._envd(request, session)
        transport = rpc_transport()
        client = FilesystemClient(envd.url, http_client=pyqwest.Client(transport))
        try:
            listed = await client.list_dir(
                fs.ListDirRequest(path=path, depth=1), headers=envd.headers(USER)
            )
        except ConnectError as e:
            raise APIError(400, f"{path}: {e.message}") from e
        finally:
            await client.close()
            await transport.aclose()
        entries = (
            Entry(e.name, e.path, e.type == fs.FileType.DIRECTORY, e.size) for e in listed.entries
        )
        sandbox_id = request.path_params["sandbox_id"]
        base = f"{PREFIX}/sandboxes/{sandbox_id}/files"
        return self.pages.render(
            request, "files.html", session, sandbox_id=sandbox_id, **listing(path, entries, base)
        )

    async def download(self, request: Request, session: Session) -> Response:
        path = absolute(request.query_params.get("path", ""), "the sandbox")
        envd = await self._envd(request, session)
        opened = contextlib.AsyncExitStack()
        try:
            answer = await opened.enter_async_context(envd.open_file(path, USER))
        except EnvdRefused as e:
            raise APIError(e.status if 400 <= e.status < 500 else 502, e.reason) from e
        except EnvdUnavailable as e:
            raise APIError(502, str(e)) from e

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_bytes():
                    yield chunk
            finally:
                await opened.aclose()

        name = quote(posixpath.basename(path) or "download")
        return StreamingResponse(
            body(),
            media_type="application/octet-stream",
            headers={"Content-Disposition": f"attachment; filename*=UTF-8''{name}"},
        )

    async def upload(self, request: Request, session: Session) -> Response:
        form = await request.form()
        directory, upload = form.get("path"), form.get("file")
        if not isinstance(directory, str) or not isinstance(upload, UploadFile):
            raise APIError(400, "path and file: required")
        name = posixpath.basename(upload.filename or "")
        if not name:
            raise APIError(400, "file: a file name is required")
        directory = absolute(directory, "the sandbox")
        envd = await self._envd(request, session)
        try:
            await envd.write_file(posixpath.join(directory, name), upload.file, USER)
        except EnvdRefused as e:
            raise APIError(e.status if 400 <= e.status < 500 else 502, e.reason) from e
        except EnvdUnavailable as e:
            raise APIError(502, str(e)) from e
        query = urlencode({"path": directory})
        sandbox_id = request.path_params["sandbox_id"]
        return RedirectResponse(f"{PREFIX}/sandboxes/{sandbox_id}/files?{query}", status_code=303)
