"""The sandbox pages: the live list with its filters and actions, and one sandbox with its
terminal's socket. Everything goes through the API with the session's key."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.websockets import WebSocket

from aenv.api.errors import APIError
from aenv.dashboard.calls import ApiRefused, KeyRefused
from aenv.dashboard.metrics import Charts, Metrics, RecentSamples
from aenv.dashboard.pages import PREFIX, Pages, seconds
from aenv.dashboard.sessions import COOKIE, Session
from aenv.dashboard.terminal import SandboxShells, Terminal

PAGE_SIZE = 50
EVENTS_SHOWN = 20
CONSOLE_LINES = 200
_STATES = {"": "running,paused", "running": "running", "paused": "paused"}


class SandboxPages:
    def __init__(self, pages: Pages, shells: SandboxShells | None) -> None:
        self.pages = pages
        self.calls = pages.calls
        # Where terminals reach sandboxes; without it (a gateway, for now) pages have none.
        self.shells = shells
        self.recent = RecentSamples()

    async def _rows(self, session: Session, view: ListView) -> tuple[str, str | None]:
        """The rendered rows of the page `view` names, and the token of the page after it."""
        params = {"state": _STATES[view.state], "limit": str(PAGE_SIZE)}
        if view.metadata:
            params["metadata"] = view.metadata
        if view.next:
            params["nextToken"] = view.next
        answer = await self.calls.call(session.key, "GET", "/v2/sandboxes", params=params)
        now = time.time()
        rows = [SandboxRow(s, now) for s in answer.json()]
        await self._sample(session, rows)
        html = self.pages.fragment("sandbox_rows.html", session, rows=rows, back=view.url)
        return html, answer.headers.get("x-next-token")

    async def _sample(self, session: Session, rows: list[SandboxRow]) -> None:
        """The running rows' current CPU and memory (the API's batch metrics), kept in
        `recent` for their sparklines; without an answer the rows show none."""
        running = [r.id for r in rows if r.state == "running"]
        if running:
            try:
                answer = await self.calls.json(
                    session.key, "/sandboxes/metrics", sandbox_ids=",".join(running)
                )
            except ApiRefused:
                return
            for sandbox_id, sample in answer["sandboxes"].items():
                self.recent.add(sandbox_id, sample)
        for row in rows:
            row.metrics = Metrics(self.recent.of(row.id))

    async def list(self, request: Request, session: Session) -> Response:
        view = ListView.of(request)
        rows, next_token = await self._rows(session, view)
        next_url = view.page(next_token) if next_token else None
        return self.pages.render(
            request, "sandboxes.html", session, view=view, rows=rows, next_url=next_url
        )

    async def live(self, request: Request, session: Session) -> Response:
        view = ListView.of(request)

        async def rows() -> str:
            return (await self._rows(session, view))[0]

        return self.pages.live_rows(request, session, rows)

    async def _panels(self, session: Session, sandbox_id: str) -> tuple[str, SandboxRow]:
        """What the sandbox page shows beside its terminal, rendered: its facts and network,
        CPU and memory over time, its events, and the tail of its console."""
        detail = await self.calls.json(session.key, f"/sandboxes/{sandbox_id}")
        events = await self.calls.json(
            session.key, f"/events/sandboxes/{sandbox_id}", limit=str(EVENTS_SHOWN)
        )
        console = await self.calls.json(
            session.key,
            f"/v2/sandboxes/{sandbox_id}/logs",
            direction="backward",
            limit=str(CONSOLE_LINES),
        )
        try:
            samples = await self.calls.json(session.key, f"/sandboxes/{sandbox_id}/metrics")
            metrics = Charts(samples)
        except ApiRefused as e:
            metrics = Charts([], unavailable=e.message)
        row = SandboxRow(detail)
        html = self.pages.fragment(
            "sandbox_panels.html",
            session,
            sandbox=row,
            network=detail.get("network") or {},
            internet=detail.get("allowInternetAccess"),
            events=events,
            console=[line["message"] for line in reversed(console["logs"])],
            metrics=metrics,
        )
        return html, row

    async def detail(self, request: Request, session: Session) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        panels, row = await self._panels(session, sandbox_id)
        terminal = self.shells is not None and row.state == "running"
        return self.pages.render(
            request, "sandbox.html", session, sandbox=row, terminal=terminal, panels=panels
        )

    async def detail_live(self, request: Request, session: Session) -> Response:
        sandbox_id = request.path_params["sandbox_id"]

        async def panels() -> str:
            return (await self._panels(session, sandbox_id))[0]

        return self.pages.live_rows(request, session, panels)

    async def terminal(self, socket: WebSocket) -> None:
        """A shell on the sandbox's PTY (`terminal.py`), for a session whose key may see the
        sandbox through the API."""
        # Browsers send cookies with another site's WebSockets, and no CORS guards them: the
        # page that opens one must be ours.
        origin = socket.headers.get("origin")
        own = f"{'https' if socket.url.scheme == 'wss' else 'http'}://{socket.headers['host']}"
        try:
            session = await self.pages.sessions.find(socket.cookies.get(COOKIE))
        except APIError as e:  # where sessions are kept does not answer (a gateway's Redis)
            await socket.close(code=4000 + e.status, reason=e.message[:120])
            return
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
            await self.pages.sessions.close(session.token)
            await socket.close(code=4401, reason="signed out")
            return
        except ApiRefused as e:
            await socket.close(code=4000 + e.status, reason=e.message[:120])
            return
        except LookupError:
            await socket.close(code=4409, reason="the sandbox is not running")
            return
        await Terminal(socket, envd).run(cols, rows, pid)

    async def act(self, request: Request, session: Session) -> Response:
        """One of the list's actions, then back to the list the form names."""
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
            case "fork":
                await self.calls.call(session.key, "POST", base + "/fork", json={})
            case "timeout":
                timeout = form.get("timeout")
                if not isinstance(timeout, str) or not timeout.isdigit():
                    raise APIError(400, "timeout: a whole number of seconds")
                await self.calls.call(
                    session.key, "POST", base + "/timeout", json={"timeout": int(timeout)}
                )
            case _:
                raise APIError(404, f"no action '{action}'")
        back = form.get("back")
        # Only a dashboard page: a form naming another site would make this an open redirect.
        if not isinstance(back, str) or not back.startswith(PREFIX + "/"):
            back = PREFIX + "/sandboxes"
        return RedirectResponse(back, status_code=303)


class ListView:
    """What a sandbox list shows: its filters and its page."""

    def __init__(self, state: str, metadata: str, next: str | None) -> None:
        self.state = state
        self.metadata = metadata
        self.next = next

    @staticmethod
    def of(request: Request) -> ListView:
        q = request.query_params
        state = q.get("state", "")
        if state not in _STATES:
            raise APIError(400, f"state: one of running, paused, not '{state}'")
        return ListView(state, q.get("metadata", "").strip(), q.get("next") or None)

    def _query(self, next: str | None) -> str:
        values = {"state": self.state, "metadata": self.metadata, "next": next or ""}
        query = urlencode({k: v for k, v in values.items() if v})
        return f"?{query}" if query else ""

    def page(self, next: str | None) -> str:
        return f"{PREFIX}/sandboxes{self._query(next)}"

    @property
    def url(self) -> str:
        return self.page(self.next)

    @property
    def live_url(self) -> str:
        return f"{PREFIX}/sandboxes/live{self._query(self.next)}"


class SandboxRow:
    """A sandbox as the pages show it, from the API's answer."""

    def __init__(self, sandbox: dict[str, Any], now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.id: str = sandbox["sandboxID"]
        self.template: str = sandbox.get("alias") or sandbox["templateID"]
        self.state: str = sandbox["state"]
        self.cpu: int = sandbox["cpuCount"]
        self.memory_mb: int = sandbox["memoryMB"]
        self.age = now - seconds(sandbox["startedAt"])
        self.left = seconds(sandbox["endAt"]) - now
        self.metadata: dict[str, str] = sandbox.get("metadata") or {}
        self.metrics: Metrics | None = None  # the list's, when sampled


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
