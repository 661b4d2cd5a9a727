"""The template pages: the templates with their newest build's state, live, and one build with
its log following live (a failed build with its reason). Read through the API's template and
build-status routes with the session's key, as the SDKs follow a build."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from aenv.api.errors import APIError
from aenv.dashboard.pages import Event, Pages, seconds
from aenv.dashboard.sessions import Session

FINISHED = ("ready", "error")
# The API's page of log entries (`api.builds.MAX_LOG_PAGE`): fewer means the end for now.
_LOG_PAGE = 100


class TemplatePages:
    def __init__(self, pages: Pages) -> None:
        self.pages = pages
        self.calls = pages.calls

    async def _rows(self, session: Session) -> str:
        listed = await self.calls.json(session.key, "/templates")
        now = time.time()
        rows = sorted((TemplateRow(t, now) for t in listed), key=lambda r: r.name)
        return self.pages.fragment("template_rows.html", session, rows=rows)

    async def list(self, request: Request, session: Session) -> Response:
        rows = await self._rows(session)
        return self.pages.render(request, "templates.html", session, rows=rows)

    async def live(self, request: Request, session: Session) -> Response:
        return self.pages.live_rows(request, session, lambda: self._rows(session))

    async def _status(self, session: Session, path: str, offset: int) -> dict[str, Any]:
        """The build's status, and every log entry from `offset` on (`logEntries`)."""
        entries: list[dict[str, Any]] = []
        while True:
            params = {"logsOffset": str(offset + len(entries)), "limit": str(_LOG_PAGE)}
            answer = (await self.calls.call(session.key, "GET", path, params=params)).json()
            entries += answer["logEntries"]
            if len(answer["logEntries"]) < _LOG_PAGE:
                answer["logEntries"] = entries
                return dict(answer)

    async def build(self, request: Request, session: Session) -> Response:
        path = _status_path(request)
        status = await self._status(session, path, 0)
        lines = self.pages.fragment("log_lines.html", session, entries=status["logEntries"])
        return self.pages.render(
            request,
            "build.html",
            session,
            build=status,
            lines=lines,
            live=None if status["status"] in FINISHED else f"{request.url.path}/live",
            offset=len(status["logEntries"]),
        )

    async def build_live(self, request: Request, session: Session) -> Response:
        """New log lines (`lines`, each event's id the offset after it) and the status as it
        changes (`status`, then `reason` for a failed build), until the build is finished."""
        path = _status_path(request)
        # A reconnecting browser says how far it got.
        given = request.headers.get("last-event-id") or request.query_params.get("offset", "0")
        if not given.isdigit():
            raise APIError(400, "offset: a whole number")
        offset = [int(given)]
        shown: list[str] = []

        async def tick() -> tuple[list[Event], bool]:
            status = await self._status(session, path, offset[0])
            sent = []
            if status["logEntries"]:
                offset[0] += len(status["logEntries"])
                lines = self.pages.fragment("log_lines.html", session, entries=status["logEntries"])
                sent.append(Event("lines", lines, id=str(offset[0])))
            if shown != [status["status"]]:
                shown[:] = [status["status"]]
                sent.append(Event("status", status["status"]))
            finished = status["status"] in FINISHED
            if finished and "reason" in status:
                sent.append(Event("reason", _reason(status["reason"])))
            return sent, finished

        return self.pages.live(request, session, tick)


class TemplateRow:
    """A template as the list shows it, from `GET /templates`."""

    def __init__(self, template: dict[str, Any], now: float) -> None:
        self.id: str = template["templateID"]
        self.name: str = (template.get("names") or [self.id])[0]
        self.build_id: str = template["buildID"]
        self.status: str = template["buildStatus"]
        self.cpu: int = template["cpuCount"]
        self.memory_mb: int = template["memoryMB"]
        self.age = now - seconds(template["createdAt"])


def _status_path(request: Request) -> str:
    params = request.path_params
    return f"/templates/{params['template_id']}/builds/{params['build_id']}/status"


def _reason(reason: dict[str, Any]) -> str:
    step = reason.get("step")
    message = str(reason.get("message", ""))
    return f"step {step}: {message}" if step is not None else message
