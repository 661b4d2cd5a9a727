"""Exchanges in flight per sandbox run (a sandbox id and its VM's incarnation).

When a run ends (its VM stopped by a kill, a pause or a crash), `end` cancels every HTTP
exchange and WebSocket to it at once: a guest that is gone never answers, not even with a
reset, so without this each one would wait for the idle timeout or the client's own deadline.
The proxy then answers what had no answer yet as a sandbox that was not found (the SDKs say the
sandbox is not running any more) and drops the rest.

`quiet_since` tells idle hibernation whether a sandbox has an exchange open, and when its
latest one started or ended.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
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
    # Per sandbox id: exchanges open (any run), and when the latest started or ended.
    _open: collections.Counter[str] = field(default_factory=collections.Counter)
    _latest: dict[str, float] = field(default_factory=dict)

    def quiet_since(self, sandbox_id: str) -> float | None:
        """None while an exchange with `sandbox_id` is open; else the `time.monotonic()` when
        the latest started or ended (0.0 when none did)."""
        if self._open[sandbox_id] > 0:
            return None
        return self._latest.get(sandbox_id, 0.0)

    @contextlib.contextmanager
    def track(self, run: Run) -> Iterator[Exchange]:
        """The current task as an exchange with `run`, for as long as the block runs."""
        task = asyncio.current_task()
        assert task is not None
        exchange = Exchange(task)
        self._exchanges.setdefault(run, set()).add(exchange)
        sandbox_id = run[0]
        self._open[sandbox_id] += 1
        self._latest[sandbox_id] = time.monotonic()
        try:
            yield exchange
        finally:
            self._open[sandbox_id] -= 1
            if self._open[sandbox_id] <= 0:
                del self._open[sandbox_id]
            self._latest[sandbox_id] = time.monotonic()
            exchanges = self._exchanges.get(run)
            if exchanges is not None:
                exchanges.discard(exchange)
                if not exchanges:
                    del self._exchanges[run]

    def end(self, run: Run) -> int:
        """Cancel every exchange with `run`; returns how many there were."""
        exchanges = self._exchanges.pop(run, set())
        self._latest.pop(run[0], None)  # the next run's clock starts with it
        for exchange in exchanges:
            exchange.ended = True
            exchange.task.cancel()
        return len(exchanges)
