"""The nodes page: what `GET /nodes` says of each node (one on `aenv server`, every node behind
a gateway), live: status, sandboxes, CPU and memory; behind a gateway, drain and undrain
(`POST /nodes/{nodeID}`, which the gateway allows the default team's keys only)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from aenv.api.errors import APIError
from aenv.dashboard.pages import PREFIX, Pages
from aenv.dashboard.sessions import Session

# What each of the page's actions asks the API to set.
_STATUSES = {"drain": "draining", "undrain": "ready"}


class NodePages:
    def __init__(self, pages: Pages, cluster: bool) -> None:
        self.pages = pages
        self.calls = pages.calls
        # Behind a gateway: nodes may be drained (a lone node has no one to take its work).
        self.cluster = cluster

    async def _rows(self, session: Session) -> str:
        nodes = [NodeRow(n) for n in await self.calls.json(session.key, "/nodes")]
        return self.pages.fragment("node_rows.html", session, nodes=nodes, cluster=self.cluster)

    async def list(self, request: Request, session: Session) -> Response:
        rows = await self._rows(session)
        return self.pages.render(request, "nodes.html", session, rows=rows)

    async def live(self, request: Request, session: Session) -> Response:
        return self.pages.live_rows(request, session, lambda: self._rows(session))

    async def act(self, request: Request, session: Session) -> Response:
        action = request.path_params["action"]
        status = _STATUSES.get(action)
        if status is None:
            raise APIError(404, f"no action '{action}'")
        node_id = quote(request.path_params["node_id"], safe="")
        await self.calls.call(session.key, "POST", f"/nodes/{node_id}", json={"status": status})
        return RedirectResponse(PREFIX + "/nodes", status_code=303)


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
