"""Waiting in tests for what happens in the background (a task, a thread, another process), and
the one bound on every such wait.

A wait is a safety net, not a measurement: it returns as soon as its condition holds, so a wait
that is longer costs a passing test nothing, and one that is too short fails a correct test on
a loaded host (CI's 2 cores run two lanes of VMs, and a step that takes 50 ms alone took 30 s
there). So every wait has the same bound, `SAFETY_S`, reached only by a hang, and no test
asserts how fast something happened. Where the code under test can say when it is done (an
event, a `DoubleDriver.hold`), a test waits on that instead of polling.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

# Under pytest-timeout's 300 s per test, so a hang fails with the wait's own message.
SAFETY_S = 240.0


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]],
    what: str = "the condition held",
    *,
    interval: float = 0.01,
) -> None:
    """Poll `condition` (a function or a coroutine function) until it is true; fail naming
    `what` after `SAFETY_S`."""
    deadline = time.monotonic() + SAFETY_S
    while True:
        done = condition()
        if inspect.isawaitable(done):
            done = await done
        if done:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {SAFETY_S:g} s: {what}")
        await asyncio.sleep(interval)


def eventually_sync(
    condition: Callable[[], T | None],
    what: str = "the condition held",
    *,
    interval: float = 0.05,
) -> T:
    """`eventually` for tests without an event loop: polls `condition` from this thread, and
    returns its first truthy value."""
    deadline = time.monotonic() + SAFETY_S
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {SAFETY_S:g} s: {what}")
        time.sleep(interval)
    return value
