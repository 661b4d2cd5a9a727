"""Per-sandbox locks: operations on one id run one at a time, and ids nobody uses any more,
unknown ones above all, leave nothing behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.config import Config
from aenv.network import NetworkConfig, SlotPool
from aenv.orchestrator.catalog import Catalog
from aenv.orchestrator.lifecycle import InvalidState, Orchestrator, SandboxNotFound
from aenv.orchestrator.locks import KeyedLocks
from aenv.orchestrator.templates import TemplateStore
from aenv.runtime.qemu import QemuDriver


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
    """A node's orchestrator that never gets to start a VM: every id it is asked about is
    unknown."""
    config = Config(home=tmp_path)
    catalog = Catalog(tmp_path / "catalog.db")
    templates = TemplateStore(tmp_path / "templates", tmp_path / "memory")
    slots = SlotPool(NetworkConfig(prefix="aenvlock"))
    orc = Orchestrator(config, catalog, QemuDriver(), slots, templates)
    try:
        yield orc
    finally:
        await orc.close()
        catalog.close()


async def test_unknown_ids_leave_no_lock_behind(orchestrator: Orchestrator) -> None:
    for n in range(200):
        unknown = f"{n:04d}" + "x" * 16_000
        assert await orchestrator.kill(unknown) is False
        for operation in (orchestrator.pause(unknown), orchestrator.resume(unknown, 10)):
            with pytest.raises((SandboxNotFound, InvalidState)):
                await operation
        with pytest.raises(SandboxNotFound):
            await orchestrator.snapshot(unknown)
    assert len(orchestrator._locks) == 0
