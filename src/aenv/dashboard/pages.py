"""What every dashboard page shares: rendering with Jinja2 (autoescaped, the session's CSRF
token and the answer's style nonce in every page), and live updates over server-sent events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse, StreamingResponse

from aenv.dashboard.calls import ApiCalls, ApiRefused, KeyRefused
from aenv.dashboard.sessions import Session, SessionStore

PREFIX = "/dashboard"
NONCE = "style_nonce"  # the answer's CSP nonce, in its request's state
# How often a live page asks the API again.
LIVE_INTERVAL_S = 2.0
# A live stream ends after this long and the browser opens it again (EventSource does): an
# open stream would otherwise hold a node's shutdown, which waits for every response to end.
STREAM_S = 30.0


@dataclass(frozen=True)
class Event:
    """One server-sent event; a browser that reconnects sends the last `id` it got back
    (`Last-Event-ID`)."""

    name: str
    data: str
    id: str | None = None

    def __str__(self) -> str:
        lines = "".join(f"data: {line}\n" for line in self.data.split("\n"))
        head = f"id: {self.id}\n" if self.id is not None else ""
        return f"{head}event: {self.name}\n{lines}\n"


# One look of a live page: the events to send, and whether nothing will change any more.
Tick = Callable[[], Awaitable[tuple[list[Event], bool]]]


class Pages:
    def __init__(
        self,
        calls: ApiCalls,
        sessions: SessionStore,
        live_interval: float = LIVE_INTERVAL_S,
        stream_s: float = STREAM_S,
    ) -> None:
        self.calls = calls
        self.sessions = sessions
        self.live_interval = live_interval
        self.stream_s = stream_s
        self.env = Environment(
            loader=PackageLoader("aenv.dashboard", "templates"),
            autoescape=select_autoescape(default=True, default_for_string=True),
        )
        self.env.filters["age"] = age

    def fragment(self, template: str, session: Session | None, **values: Any) -> str:
        return self.env.get_template(template).render(
            csrf=session.csrf if session else None, prefix=PREFIX, **values
        )

    def render(
        self,
        request: Request,
        template: str,
        session: Session | None,
        *,
        status: int = 200,
        **values: Any,
    ) -> HTMLResponse:
        nonce = request.scope["state"][NONCE]
        html = self.fragment(template, session, style_nonce=nonce, **values)
        return HTMLResponse(html, status_code=status)

    def live_rows(
        self, request: Request, session: Session, render: Callable[[], Awaitable[str]]
    ) -> StreamingResponse:
        """Server-sent events of a page part that `render` draws: event `rows` each time it
        comes out different (and at the first look)."""
        last: list[str] = []

        async def tick() -> tuple[list[Event], bool]:
            html = await render()
            if last and html == last[0]:
                return [], False
            last[:] = [html]
            return [Event("rows", html)], False

        return self.live(request, session, tick)

    def live(self, request: Request, session: Session, tick: Tick) -> StreamingResponse:
        """Server-sent events: what `tick` says at every look, until it says it is complete,
        the stream's time is up, or the browser goes. A key the API refuses ends the session
        (event `signed-out`); another refusal ends the stream (`refused`)."""

        async def events() -> AsyncIterator[str]:
            deadline = time.monotonic() + self.stream_s
            yield "retry: 1000\n\n"
            # At least one look, however late it comes: a stream always brings the state.
            while True:
                try:
                    sent, complete = await tick()
                except KeyRefused:
                    await self.sessions.close(session.token)
                    yield str(Event("signed-out", ""))
                    return
                except ApiRefused as e:
                    yield str(Event("refused", e.message))
                    return
                for sending in sent:
                    yield str(sending)
                if complete:
                    yield str(Event("complete", ""))
                    return
                await asyncio.sleep(self.live_interval)
                if time.monotonic() >= deadline or await request.is_disconnected():
                    return

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-store"}
        )


def seconds(rfc3339: str) -> float:
    """Unix time of an API timestamp."""
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def age(duration: float) -> str:
    """`3d 4h`, `2h 5m`, `4m 10s`, `7s`: the two largest units."""
    if duration <= 0:
        return "0s"
    s = int(duration)
    parts = [(s // 86400, "d"), (s % 86400 // 3600, "h"), (s % 3600 // 60, "m"), (s % 60, "s")]
    while len(parts) > 1 and parts[0][0] == 0:
        parts.pop(0)
    return " ".join(f"{n}{unit}" for n, unit in parts[:2])
