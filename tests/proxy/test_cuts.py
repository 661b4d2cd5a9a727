"""uvicorn's "returned without completing response" error is dropped only for the requests the
proxy cut on purpose; any other request's stays (it would be an application's bug)."""

from __future__ import annotations

import asyncio
import logging

from aenv.proxy import cuts


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, message, None, None)


async def test_only_requests_cut_on_purpose_are_quiet() -> None:
    quiet = cuts.QuietCuts()
    incomplete = _record(cuts.INCOMPLETE + ".")

    async def request(cut: bool) -> tuple[bool, bool]:
        if cut:
            cuts.cut()
        return quiet.filter(incomplete), quiet.filter(_record("Exception in ASGI application"))

    # Each request runs in a task of its own, as uvicorn runs them.
    cut_one, plain = await asyncio.gather(request(True), request(False))
    assert cut_one == (False, True)
    assert plain == (True, True)
    assert quiet.filter(incomplete)  # nor does the mark leak out of the request's task
