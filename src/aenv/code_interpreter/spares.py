"""A spare kernel per language, started before anyone asks for a context.

A kernel imports IPython and ipykernel first: seconds natively, minutes in a guest under TCG,
and that is what `create_code_context` waited for. The server starts one spare Python kernel
with its default one, before it answers `/health`, so a template saved with the server
running holds it: a new context takes it (after a `chdir` to the context's directory), and the
next spare starts in the background once it is taken. A spare taken in another sandbox than
the one it started in (a clone) is reseeded before its first execution like any context
(`incarnation`), since it keeps the sandbox it started in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from aenv.code_interpreter.kernel import Kernel

log = logging.getLogger(__name__)


class Spares:
    def __init__(
        self, languages: Iterable[str], start: Callable[[str], Coroutine[Any, Any, Kernel]]
    ) -> None:
        self._languages = tuple(languages)
        self._start = start
        self._tasks: dict[str, asyncio.Task[Kernel]] = {}
        # One taker at a time: the second one waits for the refill, not for a second start.
        self._taking = asyncio.Lock()

    def fill(self) -> None:
        """Start a spare for every language that has none."""
        for language in self._languages:
            if language not in self._tasks:
                self._tasks[language] = asyncio.create_task(self._start(language))

    async def ready(self) -> None:
        """Wait until every spare has started (or failed to)."""
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def take(self, language: str) -> Kernel | None:
        """The language's spare, once started, and a new one starting; None when the language
        keeps none or its spare failed to start (the caller starts a kernel itself)."""
        async with self._taking:
            task = self._tasks.get(language)
            if task is None:
                return None
            try:
                # Shielded: a caller that goes away leaves the spare for the next one.
                kernel = await asyncio.shield(task)
            except Exception as e:  # any failure: the caller starts its own
                log.warning("the spare %s kernel did not start: %r", language, e)
                kernel = None
            del self._tasks[language]
            self.fill()
            return kernel

    async def close(self) -> None:
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(k.stop() for k in done if isinstance(k, Kernel)))
