"""At most one background task per sandbox of a given kind (checkpoint uploads, the work after
a pause), so that a newer one replaces an older one and a kill or a shutdown can stop it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("aenv.orchestrator")


class PerSandbox:
    def __init__(self, what: str) -> None:
        self.what = what  # names the work in the log when it fails
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, sandbox_id: str, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` for the sandbox; a task it still had is cancelled (not waited for)."""
        previous = self._tasks.pop(sandbox_id, None)
        if previous is not None:
            previous.cancel()
        task = asyncio.get_running_loop().create_task(work)
        self._tasks[sandbox_id] = task
        task.add_done_callback(lambda t: self._done(sandbox_id, t))

    def get(self, sandbox_id: str) -> asyncio.Task[None] | None:
        return self._tasks.get(sandbox_id)

    def ids(self) -> list[str]:
        return list(self._tasks)

    async def cancel(self, sandbox_id: str) -> None:
        """Cancel the sandbox's task and wait until it has ended."""
        task = self._tasks.pop(sandbox_id, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def wait_all(self) -> None:
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def _done(self, sandbox_id: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(sandbox_id) is task:
            del self._tasks[sandbox_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("%s of sandbox %s failed: %s", self.what, sandbox_id, task.exception())
