"""The dashboard's HTTP side: its routes under `/dashboard` (the rest goes to the API),
sign-in and sign-out, and what guards every page and change.

Every page reads through `ApiCalls` with the session's key. A change is a POST carrying the
session's CSRF token from a page of the same origin; the session cookie is SameSite=Strict, so
another site's page cannot even send it. Every answer carries a Content-Security-Policy that
allows only this origin's scripts, styles and connections: the assets are the node's own files
(`static/`, with the npm libraries `scripts/build-dashboard.sh` copied into `static/vendor/`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aenv.api.app import JSON_ERRORS
from aenv.api.errors import APIError
from aenv.dashboard.builds import TemplatePages
from aenv.dashboard.calls import ApiCalls, ApiRefused, KeyRefused
from aenv.dashboard.files import FilePages
from aenv.dashboard.keys import KeyPages
from aenv.dashboard.nodes import NodePages
from aenv.dashboard.pages import LIVE_INTERVAL_S, NONCE, PREFIX, STREAM_S, Pages
from aenv.dashboard.sandboxes import SandboxPages
from aenv.dashboard.saved import SavedPages
from aenv.dashboard.sessions import COOKIE, MemorySessions, Session, SessionStore
from aenv.dashboard.terminal import SandboxShells
from aenv.dashboard.volume_files import VolumeFilePages

STATIC = Path(__file__).parent / "static"
# Styles also by the answer's nonce: xterm.js makes <style> elements as it draws, and
# terminal.js gives them the page's nonce (scripts stay this origin's files only).
CSP = (
    "default-src 'self'; style-src 'self' 'nonce-{nonce}'; base-uri 'none'; "
    "object-src 'none'; frame-ancestors 'none'; form-action 'self'"
)

Handler = Callable[[Request, Session], Awaitable[Response]]


class Dashboard:
    """The dashboard over one API app, as an ASGI app: `/dashboard` is its own, the rest goes
    to the API."""

    def __init__(
        self,
        api: ASGIApp,
        shells: SandboxShells | None = None,
        *,
        sessions: SessionStore | None = None,
        cluster: bool = False,
        live_interval: float = LIVE_INTERVAL_S,
        stream_s: float = STREAM_S,
    ) -> None:
        self.api = api
        self.calls = ApiCalls(api)
        self.sessions: SessionStore = sessions or MemorySessions()
        self.pages = Pages(self.calls, self.sessions, live_interval, stream_s)
        sandboxes = SandboxPages(self.pages, shells)
        templates = TemplatePages(self.pages)
        saved = SavedPages(self.pages)
        keys = KeyPages(self.pages)
        nodes = NodePages(self.pages, cluster)
        files = FilePages(self.pages, shells)
        volumes = VolumeFilePages(self.pages)
        sandbox = PREFIX + "/sandboxes/{sandbox_id}"
        build = PREFIX + "/templates/{template_id}/builds/{build_id}"
        routes = [
            Route(PREFIX, self.home, methods=["GET"]),
            Route(PREFIX + "/", self.home, methods=["GET"]),
            Route(PREFIX + "/sign-in", self.sign_in_page, methods=["GET"]),
            Route(PREFIX + "/sign-in", self.sign_in, methods=["POST"]),
            Route(PREFIX + "/sign-out", self._change(self.sign_out), methods=["POST"]),
            Route(PREFIX + "/sandboxes", self._page(sandboxes.list), methods=["GET"]),
            Route(PREFIX + "/sandboxes/live", self._page(sandboxes.live), methods=["GET"]),
            Route(sandbox, self._page(sandboxes.detail), methods=["GET"]),
            Route(sandbox + "/live", self._page(sandboxes.detail_live), methods=["GET"]),
            WebSocketRoute(sandbox + "/terminal", sandboxes.terminal),
            Route(sandbox + "/files", self._page(files.browse), methods=["GET"]),
            Route(sandbox + "/files/download", self._page(files.download), methods=["GET"]),
            Route(sandbox + "/files/upload", self._change(files.upload), methods=["POST"]),
            Route(sandbox + "/{action}", self._change(sandboxes.act), methods=["POST"]),
            Route(PREFIX + "/templates", self._page(templates.list), methods=["GET"]),
            Route(PREFIX + "/templates/live", self._page(templates.live), methods=["GET"]),
            Route(build, self._page(templates.build), methods=["GET"]),
            Route(build + "/live", self._page(templates.build_live), methods=["GET"]),
            Route(PREFIX + "/snapshots", self._page(saved.snapshots), methods=["GET"]),
            Route(
                PREFIX + "/snapshots/{snapshot_id}/{action}",
                self._change(saved.snapshot_action),
                methods=["POST"],
            ),
            Route(PREFIX + "/volumes", self._page(saved.volumes), methods=["GET"]),
            Route(PREFIX + "/volumes", self._change(saved.create_volume), methods=["POST"]),
            Route(
                PREFIX + "/volumes/{volume_id}/files", self._page(volumes.browse), methods=["GET"]
            ),
            Route(
                PREFIX + "/volumes/{volume_id}/files/download",
                self._page(volumes.download),
                methods=["GET"],
            ),
            Route(
                PREFIX + "/volumes/{volume_id}/delete",
                self._change(saved.delete_volume),
                methods=["POST"],
            ),
            Route(PREFIX + "/keys", self._page(keys.list), methods=["GET"]),
            Route(PREFIX + "/keys", self._change(keys.create), methods=["POST"]),
            Route(PREFIX + "/keys/{key_id}/revoke", self._change(keys.revoke), methods=["POST"]),
            Route(PREFIX + "/nodes", self._page(nodes.list), methods=["GET"]),
            Route(PREFIX + "/nodes/live", self._page(nodes.live), methods=["GET"]),
            Route(PREFIX + "/nodes/{node_id}/{action}", self._change(nodes.act), methods=["POST"]),
            Mount(PREFIX + "/static", StaticFiles(directory=STATIC), name="static"),
        ]
        self._app = _Headers(Starlette(routes=routes, exception_handlers=JSON_ERRORS))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and (
            path == PREFIX or path.startswith(PREFIX + "/")
        ):
            await self._app(scope, receive, send)
        else:
            await self.api(scope, receive, send)

    # -- sessions -------------------------------------------------------------------------

    async def _session(self, request: Request) -> Session | None:
        return await self.sessions.find(request.cookies.get(COOKIE))

    def _page(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """A GET of a signed-in session; without one, the sign-in page."""

        async def page(request: Request) -> Response:
            session = await self._session(request)
            if session is None:
                return _to_sign_in()
            return await self._run(handler, request, session)

        return page

    def _change(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """A POST of a signed-in session, from a page of this origin, with its CSRF token."""

        async def change(request: Request) -> Response:
            _same_origin(request)
            session = await self._session(request)
            if session is None:
                raise APIError(401, "not signed in")
            form = await request.form()
            given = request.headers.get("x-csrf-token") or form.get("csrf")
            if not session.csrf_ok(given if isinstance(given, str) else None):
                raise APIError(403, "missing or wrong CSRF token")
            return await self._run(handler, request, session)

        return change

    async def _run(self, handler: Handler, request: Request, session: Session) -> Response:
        try:
            return await handler(request, session)
        except KeyRefused:
            await self.sessions.close(session.token)
            return _to_sign_in()
        except ApiRefused as e:
            return self.pages.render(
                request, "error.html", session, status=e.status, code=e.status, message=e.message
            )

    # -- sign-in --------------------------------------------------------------------------

    async def home(self, request: Request) -> Response:
        return RedirectResponse(PREFIX + "/sandboxes", status_code=303)

    async def sign_in_page(self, request: Request) -> Response:
        return self.pages.render(request, "sign_in.html", None)

    async def sign_in(self, request: Request) -> Response:
        _same_origin(request)
        form = await request.form()
        key = form.get("key")
        if not isinstance(key, str) or not key.strip():
            return self.pages.render(
                request, "sign_in.html", None, status=400, error="Enter an API key."
            )
        key = key.strip()
        try:
            # The key is judged by the API, as any client's is, on the route the first page
            # reads (every key may list its sandboxes, on a node and on a gateway).
            await self.calls.call(key, "GET", "/v2/sandboxes", params={"limit": "1"})
        except ApiRefused as e:
            return self.pages.render(
                request, "sign_in.html", None, status=e.status, error=e.message
            )
        except KeyRefused:
            return self.pages.render(
                request, "sign_in.html", None, status=401, error="Invalid API key."
            )
        session = await self.sessions.open(key)
        response = RedirectResponse(PREFIX + "/sandboxes", status_code=303)
        response.set_cookie(
            COOKIE,
            session.token,
            max_age=int(self.sessions.lifetime),
            path=PREFIX,
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        return response

    async def sign_out(self, request: Request, session: Session) -> Response:
        await self.sessions.close(session.token)
        response = _to_sign_in()
        response.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
        return response


def _to_sign_in() -> Response:
    return RedirectResponse(PREFIX + "/sign-in", status_code=303)


def _same_origin(request: Request) -> None:
    """Refuse a POST another site's page made: browsers say where a request comes from in
    `Sec-Fetch-Site` (and `Origin`), which a page cannot forge."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        raise APIError(403, f"cross-site request refused ({site})")
    origin = request.headers.get("origin")
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin is not None and origin != own:
        raise APIError(403, f"cross-origin request refused ({json.dumps(origin)})")


class _Headers:
    """Adds the dashboard's security headers to every answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        nonce = secrets.token_urlsafe(16)
        scope.setdefault("state", {})[NONCE] = nonce

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["Content-Security-Policy"] = CSP.format(nonce=nonce)
                headers["X-Content-Type-Options"] = "nosniff"
                # Not `no-referrer`: Chromium then sends `Origin: null` with the pages' own
                # forms, which `_same_origin` must refuse.
                headers["Referrer-Policy"] = "same-origin"
                headers.setdefault("Cache-Control", "no-store")
            await send(message)

        await self.app(scope, receive, with_headers)
