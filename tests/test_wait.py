"""The tests' one wait (tests/support/wait.py): it returns once its condition holds, however
long that took, and fails naming what it waited for only past its safety bound."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest

from tests.support import wait


async def test_it_returns_once_background_work_is_done() -> None:
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, done.set)
    await wait.eventually(done.is_set, "the event set")
    calls = itertools.count()

    async def third_call() -> bool:
        return next(calls) == 2

    await wait.eventually(third_call, "the third call")


def test_the_thread_variant_returns_the_first_truthy_value() -> None:
    found: list[str] = []
    threading.Timer(0.05, found.append, ("it",)).start()
    assert wait.eventually_sync(lambda: found[0] if found else None, "the timer ran") == "it"


async def test_only_the_safety_bound_fails_and_it_names_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wait, "SAFETY_S", 0.05)
    with pytest.raises(AssertionError, match=r"not within 0\.05 s: the pool refilled"):
        await wait.eventually(lambda: False, "the pool refilled")
    with pytest.raises(AssertionError, match=r"not within 0\.05 s: the VMM exited"):
        wait.eventually_sync(lambda: None, "the VMM exited")
