"""One asyncio lock per key, for as long as someone holds or waits for it.

The orchestrator serialises the operations on one sandbox with such a lock. Callers name
sandboxes that never existed too (an id in a URL), so an entry lives only while it is in use:
a map that kept every key seen would grow with every unknown id."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass
class _Entry:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # holders and waiters


class KeyedLocks:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        """Hold `key`'s lock for the block; the entry goes with its last user."""
        entry = self._entries.setdefault(key, _Entry())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._entries[key]
