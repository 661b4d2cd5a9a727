"""The dashboard's HTTP side: its routes under `/dashboard`, sign-in and sign-out, the pages
(rendered on the server with Jinja2), their live updates (server-sent events) and the actions
their forms post.

Every page reads through `ApiCalls` with the session's key. A change is a POST carrying the
session's CSRF token from a page of the same origin; the session cookie is SameSite=Strict, so
another site's page cannot even send it. Every answer carries a Content-Security-Policy that
allows only this origin's scripts, styles and connections: the assets are the node's own files
(`static/`, with the npm libraries `scripts/build-dashboard.sh` copied into `static/vendor/`).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket

from aenv.api.app import JSON_ERRORS
from aenv.api.errors import APIError
from aenv.dashboard.calls import ApiCalls, ApiRefused, KeyRefused
from aenv.dashboard.sessions import COOKIE, Session, Sessions
from aenv.dashboard.terminal import SandboxShells, Terminal

PREFIX = "/dashboard"
STATIC = Path(__file__).parent / "static"
# Styles also by the answer's nonce: xterm.js makes <style> elements as it draws, and
# terminal.js gives them the page's nonce (scripts stay this origin's files only).
CSP = (
    "default-src 'self'; style-src 'self' 'nonce-{nonce}'; base-uri 'none'; "
    "object-src 'none'; frame-ancestors 'none'; form-action 'self'"
)
PAGE_SIZE = 50
# How often a live page asks the API again.
LIVE_INTERVAL_S = 2.0
# A live stream ends after this long and the browser opens it again (EventSource does): an
# open stream would otherwise hold a node's shutdown, which waits for every response to end.
STREAM_S = 30.0
_NONCE = "style_nonce"  # the answer's CSP nonce, in its request's state
_STATES = {"": "running,paused", "running": "running", "paused": "paused"}

Handler = Callable[[Request, Session], Awaitable[Response]]


class Dashboard:
    """The dashboard over one API app, as an ASGI app: `/dashboard` is its own, the rest goes
    to the API."""

    def __init__(
        self,
        api: ASGIApp,
        shells: SandboxShells | None = None,
        *,
        live_interval: float = LIVE_INTERVAL_S,
        stream_s: float = STREAM_S,
    ) -> None:
        self.api = api
        # Where terminals reach sandboxes; without it (a gateway, for now) pages have none.
        self.shells = shells
        self.calls = ApiCalls(api)
        self.sessions = Sessions()
        self.live_interval = live_interval
        self.stream_s = stream_s
        self.pages = Environment(
            loader=PackageLoader("aenv.dashboard", "templates"),
            autoescape=select_autoescape(default=True, default_for_string=True),
        )
        self.pages.filters["age"] = _age
        routes = [
            Route(PREFIX, self.home, methods=["GET"]),
            Route(PREFIX + "/", self.home, methods=["GET"]),
            Route(PREFIX + "/sign-in", self.sign_in_page, methods=["GET"]),
            Route(PREFIX + "/sign-in", self.sign_in, methods=["POST"]),
            Route(PREFIX + "/sign-out", self._change(self.sign_out), methods=["POST"]),
            Route(PREFIX + "/sandboxes", self._page(self.sandboxes), methods=["GET"]),
            Route(PREFIX + "/sandboxes/live", self._page(self.sandboxes_live), methods=["GET"]),
            Route(PREFIX + "/sandboxes/{sandbox_id}", self._page(self.sandbox), methods=["GET"]),
            WebSocketRoute(PREFIX + "/sandboxes/{sandbox_id}/terminal", self.terminal),
            Route(
                PREFIX + "/sandboxes/{sandbox_id}/{action}",
                self._change(self.sandbox_action),
                methods=["POST"],
            ),
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

    def _session(self, request: Request) -> Session | None:
        return self.sessions.find(request.cookies.get(COOKIE))

    def _page(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """A GET of a signed-in session; without one, the sign-in page."""

        async def page(request: Request) -> Response:
            session = self._session(request)
            if session is None:
                return _to_sign_in()
            return await self._run(handler, request, session)

        return page

    def _change(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """A POST of a signed-in session, from a page of this origin, with its CSRF token."""

        async def change(request: Request) -> Response:
            _same_origin(request)
            session = self._session(request)
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
            self.sessions.close(session.token)
            return _to_sign_in()
        except ApiRefused as e:
            return self._render(
                request, "error.html", session, status=e.status, code=e.status, message=e.message
            )

    def _render(
        self,
        request: Request,
        page: str,
        session: Session | None,
        *,
        status: int = 200,
        **values: Any,
    ) -> HTMLResponse:
        html = self.pages.get_template(page).render(
            csrf=session.csrf if session else None,
            prefix=PREFIX,
            style_nonce=request.scope["state"][_NONCE],
            **values,
        )
        return HTMLResponse(html, status_code=status)

    # -- sign-in --------------------------------------------------------------------------

    async def home(self, request: Request) -> Response:
        return RedirectResponse(PREFIX + "/sandboxes", status_code=303)

    async def sign_in_page(self, request: Request) -> Response:
        return self._render(request, "sign_in.html", None)

    async def sign_in(self, request: Request) -> Response:
        _same_origin(request)
        form = await request.form()
        key = form.get("key")
        if not isinstance(key, str) or not key.strip():
            return self._render(
                request, "sign_in.html", None, status=400, error="Enter an API key."
            )
        key = key.strip()
        try:
            # The key is judged by the API, as any client's is.
            await self.calls.call(key, "GET", "/teams")
        except KeyRefused:
            return self._render(request, "sign_in.html", None, status=401, error="Invalid API key.")
        session = self.sessions.open(key)
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
        self.sessions.close(session.token)
        response = _to_sign_in()
        response.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
        return response

    # -- sandboxes ------------------------------------------------------------------------

    async def _sandbox_rows(self, session: Session, view: _ListView) -> tuple[str, str | None]:
        """The rendered rows of the page `view` names, and the token of the page after it."""
        params = {"state": _STATES[view.state], "limit": str(PAGE_SIZE)}
        if view.metadata:
            params["metadata"] = view.metadata
        if view.next:
            params["nextToken"] = view.next
        answer = await self.calls.call(session.key, "GET", "/v2/sandboxes", params=params)
        now = time.time()
        rows = [_SandboxRow(s, now) for s in answer.json()]
        html = self.pages.get_template("sandbox_rows.html").render(
            rows=rows, csrf=session.csrf, prefix=PREFIX, back=view.url
        )
        return html, answer.headers.get("x-next-token")

    async def sandboxes(self, request: Request, session: Session) -> Response:
        view = _ListView.of(request)
        rows, next_token = await self._sandbox_rows(session, view)
        return self._render(
            request,
            "sandboxes.html",
            session,
            view=view,
            rows=rows,
            next_url=view.page(next_token) if next_token else None,
        )

    async def sandboxes_live(self, request: Request, session: Session) -> Response:
        view = _ListView.of(request)

        async def events() -> AsyncIterator[str]:
            last = None
            deadline = time.monotonic() + self.stream_s
            yield "retry: 1000\n\n"
            while time.monotonic() < deadline and not await request.is_disconnected():
                try:
                    rows, _ = await self._sandbox_rows(session, view)
                except KeyRefused:
                    self.sessions.close(session.token)
                    yield _event("signed-out", "")
                    return
                except ApiRefused as e:
                    yield _event("refused", e.message)
                    return
                if rows != last:
                    yield _event("rows", rows)
                    last = rows
                await asyncio.sleep(self.live_interval)

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-store"}
        )

    async def sandbox(self, request: Request, session: Session) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        detail = await self.calls.json(session.key, f"/sandboxes/{sandbox_id}")
        row = _SandboxRow(detail, time.time())
        terminal = self.shells is not None and row.state == "running"
        return self._render(request, "sandbox.html", session, sandbox=row, terminal=terminal)

    async def terminal(self, socket: WebSocket) -> None:
        """A shell on the sandbox's PTY (`terminal.py`), for a session whose key may see the
        sandbox through the API."""
        # Browsers send cookies with another site's WebSockets, and no CORS guards them: the
        # page that opens one must be ours.
        origin = socket.headers.get("origin")
        own = f"{'https' if socket.url.scheme == 'wss' else 'http'}://{socket.headers['host']}"
        session = self.sessions.find(socket.cookies.get(COOKIE))
        if origin != own or session is None or self.shells is None:
            await socket.close(code=1008)
            return
        await socket.accept()
        sandbox_id = socket.path_params["sandbox_id"]
        try:
            cols, rows, pid = _terminal_query(socket)
            await self.calls.call(session.key, "GET", f"/sandboxes/{sandbox_id}")
            envd = await self.shells.envd(sandbox_id)
        except KeyRefused:
            self.sessions.close(session.token)
            await socket.close(code=4401, reason="signed out")
            return
        except ApiRefused as e:
            await socket.close(code=4000 + e.status, reason=e.message[:120])
            return
        except LookupError:
            await socket.close(code=4409, reason="the sandbox is not running")
            return
        await Terminal(socket, envd).run(cols, rows, pid)

    async def sandbox_action(self, request: Request, session: Session) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        action = request.path_params["action"]
        form = await request.form()
        base = f"/sandboxes/{sandbox_id}"
        match action:
            case "kill":
                await self.calls.call(session.key, "DELETE", base)
            case "pause":
                await self.calls.call(session.key, "POST", base + "/pause")
            case "resume":
                await self.calls.call(session.key, "POST", base + "/resume", json={})
            case "snapshot":
                await self.calls.call(session.key, "POST", base + "/snapshots", json={})
            case "timeout":
                seconds = form.get("timeout")
                if not isinstance(seconds, str) or not seconds.isdigit():
                    raise APIError(400, "timeout: a whole number of seconds")
                await self.calls.call(
                    session.key, "POST", base + "/timeout", json={"timeout": int(seconds)}
                )
            case _:
                raise APIError(404, f"no action '{action}'")
        back = form.get("back")
        # Only a dashboard page: a form naming another site would make this an open redirect.
        if not isinstance(back, str) or not back.startswith(PREFIX + "/"):
            back = PREFIX + "/sandboxes"
        return RedirectResponse(back, status_code=303)


class _ListView:
    """What a sandbox list shows: its filters and its page."""

    def __init__(self, state: str, metadata: str, next: str | None) -> None:
        self.state = state
        self.metadata = metadata
        self.next = next

    @staticmethod
    def of(request: Request) -> _ListView:
        q = request.query_params
        state = q.get("state", "")
        if state not in _STATES:
            raise APIError(400, f"state: one of running, paused, not '{state}'")
        return _ListView(state, q.get("metadata", "").strip(), q.get("next") or None)

    def query(self, next: str | None) -> str:
        values = {"state": self.state, "metadata": self.metadata, "next": next or ""}
        return urlencode({k: v for k, v in values.items() if v})

    def page(self, next: str | None) -> str:
        query = self.query(next)
        return f"{PREFIX}/sandboxes" + (f"?{query}" if query else "")

    @property
    def url(self) -> str:
        return self.page(self.next)

    @property
    def live_url(self) -> str:
        query = self.query(self.next)
        return f"{PREFIX}/sandboxes/live" + (f"?{query}" if query else "")


class _SandboxRow:
    def __init__(self, sandbox: dict[str, Any], now: float) -> None:
        self.id: str = sandbox["sandboxID"]
        self.template: str = sandbox.get("alias") or sandbox["templateID"]
        self.state: str = sandbox["state"]
        self.cpu: int = sandbox["cpuCount"]
        self.memory_mb: int = sandbox["memoryMB"]
        self.age = now - _seconds(sandbox["startedAt"])
        self.left = _seconds(sandbox["endAt"]) - now
        self.metadata: dict[str, str] = sandbox.get("metadata") or {}


def _terminal_query(socket: WebSocket) -> tuple[int, int, int | None]:
    """The terminal's size and the shell to attach to, from its URL's query."""
    q = socket.query_params
    try:
        cols, rows = int(q.get("cols", "80")), int(q.get("rows", "24"))
        pid = int(q["pid"]) if q.get("pid") else None
    except ValueError as e:
        raise ApiRefused(400, "cols, rows and pid are whole numbers") from e
    if not (1 <= cols <= 1000 and 1 <= rows <= 1000):
        raise ApiRefused(400, "cols and rows: between 1 and 1000")
    return cols, rows, pid


def _seconds(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def _age(seconds: float) -> str:
    """`3d 4h`, `2h 5m`, `4m 10s`, `7s`: the two largest units."""
    if seconds <= 0:
        return "0s"
    s = int(seconds)
    parts = [(s // 86400, "d"), (s % 86400 // 3600, "h"), (s % 3600 // 60, "m"), (s % 60, "s")]
    while len(parts) > 1 and parts[0][0] == 0:
        parts.pop(0)
    return " ".join(f"{n}{unit}" for n, unit in parts[:2])


def _event(name: str, data: str) -> str:
    lines = "".join(f"data: {line}\n" for line in data.split("\n"))
    return f"event: {name}\n{lines}\n"


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
        scope.setdefault("state", {})[_NONCE] = nonce

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
