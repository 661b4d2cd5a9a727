"""Exchanges in flight per sandbox run (a sandbox id and its VM's incarnation).

When a run ends (its VM stopped by a kill, a pause or a crash), `end` cancels every HTTP
exchange and WebSocket to it at once: a guest that is gone never answers, not even with a
reset, so without this each one would wait for the idle timeout or the client's own deadline.
The proxy then answers what had no answer yet as a sandbox that was not found (the SDKs say the
sandbox is not running any more) and drops the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from starlette.types import Message, Send

Run = tuple[str, str]  # (sandbox id, incarnation)


@dataclass(eq=False)  # by identity: exchanges live in sets
class Exchange:
    """One request or WebSocket being forwarded to a run."""

    task: asyncio.Task[object]
    started: bool = False  # response headers sent, or the WebSocket accepted
    ended: bool = False  # cancelled because its run ended

    def watch(self, send: Send) -> Send:
        """`send`, noting when the answer has started."""

        async def watched(message: Message) -> None:
            if message["type"] in ("http.response.start", "websocket.accept"):
                self.started = True
            await send(message)

        return watched


@dataclass
class Runs:
    _exchanges: dict[Run, set[Exchange]] = field(default_factory=dict)

    @contextlib.contextmanager
    def track(self, run: Run) -> Iterator[Exchange]:
        """The current task as an exchange with `run`, for as long as the block runs."""
        task = asyncio.current_task()
        assert task is not None
        exchange = Exchange(task)
        self._exchanges.setdefault(run, set()).add(exchange)
        try:
            yield exchange
        finally:
            exchanges = self._exchanges.get(run)
            if exchanges is not None:
                exchanges.discard(exchange)
                if not exchanges:
                    del self._exchanges[run]

    def end(self, run: Run) -> int:
        """Cancel every exchange with `run`; returns how many there were."""
        exchanges = self._exchanges.pop(run, set())
        for exchange in exchanges:
            exchange.ended = True
            exchange.task.cancel()
        return len(exchanges)
