"""The nodes page: what `GET /nodes` says of each node (one on `aenv server`, every node behind
a gateway), live: status, sandboxes, CPU and memory."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from aenv.dashboard.pages import Pages
from aenv.dashboard.sessions import Session


class NodePages:
    def __init__(self, pages: Pages) -> None:
        self.pages = pages
        self.calls = pages.calls

    async def _rows(self, session: Session) -> str:
        nodes = [NodeRow(n) for n in await self.calls.json(session.key, "/nodes")]
        return self.pages.fragment("node_rows.html", session, nodes=nodes)

    async def list(self, request: Request, session: Session) -> Response:
        rows = await self._rows(session)
        return self.pages.render(request, "nodes.html", session, rows=rows)

    async def live(self, request: Request, session: Session) -> Response:
        return self.pages.live_rows(request, session, lambda: self._rows(session))


class NodeRow:
    def __init__(self, node: dict[str, Any]) -> None:
        metrics = node.get("metrics") or {}
        gib = 1 << 30
        self.id: str = node["id"]
        self.status: str = node["status"]
        self.sandboxes: int = node.get("sandboxCount", 0)
        self.starting: int = node.get("sandboxStartingCount", 0)
        self.version: str = node.get("version", "")
        self.cpu = f"{metrics.get('cpuPercent', 0)}% of {metrics.get('cpuCount', 0)}"
        used, total = metrics.get("memoryUsedBytes", 0), metrics.get("memoryTotalBytes", 0)
        self.memory = f"{used / gib:.1f} / {total / gib:.1f} GiB"
