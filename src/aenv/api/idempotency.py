"""Idempotent creates: `POST /sandboxes` with an `Idempotency-Key` header starts at most one
sandbox per key and API key; a retry within the window, or one sent while the first is still
starting, answers what the first did.

Kept in memory: a key outlives neither the window nor a restart of the server. A create that
failed is forgotten (nothing was started), so a retry tries again; so is one whose sandbox is
gone (killed, or timed out): answering with a dead sandbox's id would leave the client nothing
to use, so a retry starts a new one.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aenv.api.errors import APIError

HEADER = "Idempotency-Key"
# What the SDKs send (`retry.resolve_idempotency_key` checks this shape before sending).
_KEY = re.compile(r"[A-Za-z0-9_.:-]{1,255}")
DEFAULT_WINDOW = 600.0
DEFAULT_MAX_KEYS = 10_000

Result = dict[str, Any]
Scope = tuple[str, str]  # (API key id, idempotency key)


@dataclass
class _Entry:
    request: str  # the create's validated body, to refuse a key reused for another request
    task: asyncio.Task[Result]
    expires: float = float("inf")  # monotonic; set when the create succeeded

    def made(self) -> Result | None:
        """What the create answered, once it has succeeded."""
        task = self.task
        if not task.done() or task.cancelled() or task.exception() is not None:
            return None
        return task.result()


def check_key(key: str) -> str:
    if not _KEY.fullmatch(key):
        raise APIError(400, f"{HEADER} must be 1-255 letters, digits, '-', '_', '.' or ':'")
    return key


class IdempotentCreates:
    def __init__(self, window: float = DEFAULT_WINDOW, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self.window = window
        self.max_keys = max_keys
        self._entries: dict[Scope, _Entry] = {}

    async def once(
        self,
        scope: Scope,
        request: str,
        create: Callable[[], Awaitable[Result]],
        lives: Callable[[Result], bool],
    ) -> Result:
        """What `create` answers, run once for `scope` within the window and while `lives`
        says what it made still exists."""
        self._forget_expired()
        entry = self._entries.get(scope)
        made = None if entry is None else entry.made()
        if made is not None and not lives(made):
            del self._entries[scope]
            entry = None
        if entry is None:
            if len(self._entries) >= self.max_keys:
                raise APIError(429, f"more than {self.max_keys} idempotency keys in use")
            # A task of its own: a client that hangs up must not cancel the create its retry
            # is about to wait for.
            entry = _Entry(request, asyncio.ensure_future(create()))
            self._entries[scope] = entry
            entry.task.add_done_callback(lambda task: self._settled(scope, task))
        elif entry.request != request:
            raise APIError(422, f"{HEADER} '{scope[1]}' was used for a different create request")
        return await asyncio.shield(entry.task)

    def _settled(self, scope: Scope, task: asyncio.Task[Result]) -> None:
        entry = self._entries.get(scope)
        if entry is None or entry.task is not task:
            return
        if task.cancelled() or task.exception() is not None:
            del self._entries[scope]
        else:
            entry.expires = time.monotonic() + self.window

    def _forget_expired(self) -> None:
        now = time.monotonic()
        for scope in [s for s, e in self._entries.items() if e.expires <= now]:
            del self._entries[scope]
