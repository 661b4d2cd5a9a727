"""`GET /v2/sandboxes` across nodes: every node's page for the same query, merged into one.

A node's `nextToken` is a position (started at, sandbox id), not an offset, so one token means the
same on every node: the gateway sends each node the client's query and token, and each answers
its next `limit` sandboxes past that position with each one's own cursor (`CURSORS_HEADER`). The
merged page is the first `limit` of their union in the list's order; its token is the cursor of
its last sandbox, and there is a next page when some node had more or the union was longer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aenv.api.errors import APIError
from aenv.api.internal import CURSORS_HEADER
from aenv.api.sandboxes import MAX_PAGE, cursor_key
from aenv.gateway.nodes import Answer


@dataclass(frozen=True)
class Listed:
    sandbox: dict[str, Any]
    cursor: str
    position: tuple[float, str]


@dataclass(frozen=True)
class Page:
    sandboxes: list[dict[str, Any]]
    next_token: str | None


def page_limit(value: str | None) -> int:
    """The page size the client asked for; the nodes check its bounds and answer 400."""
    try:
        return MAX_PAGE if value is None else int(value)
    except ValueError:
        return MAX_PAGE


def merge(answers: list[Answer], limit: int, ascending: bool) -> Page:
    """The merged page of nodes' successful `answers` (see the module docstring)."""
    items: list[Listed] = []
    more = False
    for answer in answers:
        headers = {n.lower(): v for n, v in answer.headers}
        more = more or "x-next-token" in headers
        sandboxes = json.loads(answer.body)
        cursors = [c for c in headers.get(CURSORS_HEADER.lower(), "").split(",") if c]
        if len(cursors) != len(sandboxes):
            raise APIError(502, "a node answered its list without one cursor per sandbox")
        items += [Listed(s, c, cursor_key(c)) for s, c in zip(sandboxes, cursors, strict=True)]
    items.sort(key=lambda i: i.position, reverse=not ascending)
    page = items[:limit]
    more = more or len(items) > limit
    return Page([i.sandbox for i in page], page[-1].cursor if more and page else None)
