"""Per-sandbox locks: operations on one id run one at a time, and ids nobody uses any more,
unknown ones above all, leave nothing behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.orchestrator.lifecycle import InvalidState, Orchestrator, SandboxNotFound
from aenv.orchestrator.locks import KeyedLocks
from tests.doubles.node import double_node


async def test_one_holder_at_a_time_and_no_entry_once_released() -> None:
    locks = KeyedLocks()
    order: list[str] = []

    async def hold(name: str) -> None:
        async with locks.hold("a"):
            order.append(f"{name} in")
            await asyncio.sleep(0.01)
            order.append(f"{name} out")

    await asyncio.gather(hold("first"), hold("second"))
    assert order == ["first in", "first out", "second in", "second out"]
    assert len(locks) == 0


async def test_a_waiter_keeps_the_entry() -> None:
    locks = KeyedLocks()
    inside = asyncio.Event()
    release = asyncio.Event()

    async def holder() -> None:
        async with locks.hold("a"):
            inside.set()
            await release.wait()

    first = asyncio.create_task(holder())
    await inside.wait()
    waiter = asyncio.create_task(holder())
    await asyncio.sleep(0)
    waiter.cancel()  # a waiter that gives up leaves the holder's entry alone
    await asyncio.gather(waiter, return_exceptions=True)
    assert len(locks) == 1
    release.set()
    await first
    assert len(locks) == 0


@pytest.fixture
async def orchestrator(tmp_path: Path) -> AsyncIterator[Orchestrator]:
    async with double_node(tmp_path) as node:
        yield node.orchestrator


async def test_unknown_ids_leave_no_lock_behind(orchestrator: Orchestrator) -> None:
    for n in range(200):
        unknown = f"{n:04d}" + "x" * 16_000
        assert await orchestrator.kill(unknown) is False
        for operation in (orchestrator.pause(unknown), orchestrator.resume(unknown, 10)):
            with pytest.raises((SandboxNotFound, InvalidState)):
                await operation
        with pytest.raises(SandboxNotFound):
            await orchestrator.snapshot(unknown)
    assert len(orchestrator.node.locks) == 0
