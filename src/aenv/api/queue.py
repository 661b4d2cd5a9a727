"""Waiting for capacity at the HTTP edge: the watch that takes a
waiter out of the queue when its client disconnects (on a node, and on a gateway, which drops
its call to the node), and `GET /aenv/queue`, where the caller's waiters stand
(`orchestrator/waiting.py` owns the queue). The `X-Aenv-Wait` header a create or fork asks to
wait by (an unmodified E2B SDK sends it through its `headers` option) is read by
`limits.wait_of`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError
from aenv.api.extensions import QUEUE
from aenv.api.requests import check_query
from aenv.api.scope import team_of
from aenv.config import Config
from aenv.orchestrator.lifecycle import Orchestrator

T = TypeVar("T")


@dataclass(frozen=True)
class Waiting:
    """What a create may wait for capacity: its seconds, and its client's leaving."""

    wait: float
    gone: asyncio.Event | None


@contextlib.asynccontextmanager
async def client_gone(request: Request, wait: float) -> AsyncIterator[asyncio.Event | None]:
    """An event set when the client disconnects, for a request that may wait (None for one
    that does not): the server does not cancel a handler whose client left, and a waiter
    nobody will answer must not take a place when one frees."""
    if wait <= 0:
        yield None
        return
    gone = asyncio.Event()

    async def watch() -> None:
        # The body was read: the next message is the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone.set()

    watcher = asyncio.create_task(watch())
    try:
        yield gone
    finally:
        watcher.cancel()


async def until_gone(work: Coroutine[Any, Any, T], gone: asyncio.Event | None) -> T:
    """`work`, cancelled when `gone` is set first (a gateway's call to a node: dropping it
    has the node's waiter leave its queue); the answer to a client gone is a 499."""
    if gone is None:
        return await work
    task = asyncio.ensure_future(work)
    left = asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait([task, left], return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise APIError(499, "the client went away while waiting for capacity")
    return task.result()


class QueueRoutes:
    def __init__(self, orchestrator: Orchestrator, config: Config) -> None:
        self.orc = orchestrator
        self.config = config

    def routes(self) -> list[Route]:
        return [Route(QUEUE, self.queue, methods=["GET"])]

    async def queue(self, request: Request) -> Response:
        """The node's waiters, and where the caller's team's stand (1 is served next)."""
        check_query(request)
        waiting = self.orc.waiting
        return JSONResponse(
            {
                "waiting": len(waiting),
                "positions": waiting.positions(team_of(request)),
                "maxWait": self.config.create_max_wait,
            }
        )
