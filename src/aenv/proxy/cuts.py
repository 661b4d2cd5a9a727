"""Answers the proxy ends incomplete on purpose, and uvicorn's log of them.

Once an HTTP answer's headers are out, the only way left to tell the client that the rest will
not come (its sandbox was killed or paused mid-stream, the sandbox's side of the connection was
cut, the exchange went idle) is to return without the answer's end: uvicorn then drops the
client's connection. It also logs "ASGI callable returned without completing response" at
ERROR, meant for an application's bug: for these it is noise, one line per open stream of
every sandbox killed. `cut()` marks the current request; `QuietCuts`, on uvicorn's error
logger, drops that line for marked requests only. uvicorn logs it in the request's own task
right after the app returns, so the mark (a context variable) is still there, and no other
request sees it.
"""

from __future__ import annotations

import contextvars
import logging

INCOMPLETE = "ASGI callable returned without completing response"

_cut: contextvars.ContextVar[bool] = contextvars.ContextVar("aenv_proxy_cut", default=False)


def cut() -> None:
    """The current request's answer ends incomplete on purpose."""
    _cut.set(True)


class QuietCuts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (_cut.get() and record.getMessage().startswith(INCOMPLETE))


def quiet_uvicorn() -> None:
    """Install `QuietCuts` on uvicorn's error logger (once)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, QuietCuts) for f in logger.filters):
        logger.addFilter(QuietCuts())
