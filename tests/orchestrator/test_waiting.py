"""Creates and forks that wait for capacity: served round robin across owners and FIFO within
one, woken by a kill (no polling), refused with the reason when the wait runs out, and gone
from the queue when their client leaves."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from aenv.orchestrator.catalog import SandboxRecord
from aenv.orchestrator.lifecycle import CapacityReached
from aenv.orchestrator.waiting import WaitQueue
from tests.doubles.node import DoubleNode, assert_clean, double_node
from tests.support.wait import eventually

LONG = 3600.0  # a wait that never runs out in these tests


async def _join(node: DoubleNode, owner: str, count: int) -> asyncio.Task[Any]:
    """A create by `owner` that waits, once it stands in the queue as its `count`th."""
    task = asyncio.create_task(node.orchestrator.create(node.request(team_id=owner, wait=LONG)))
    await eventually(lambda: len(node.orchestrator.node.waiting) == count, f"{count} waiting")
    return task


async def _kill_all(node: DoubleNode) -> None:
    for record in node.orchestrator.list():
        await node.orchestrator.kill(record.id)
    assert len(node.orchestrator.node.waiting) == 0
    assert node.orchestrator.node.starting.count == 0
    assert_clean(node)


async def test_waiters_of_two_keys_are_served_alternately(tmp_path: Path) -> None:
    async with double_node(tmp_path, max_sandboxes=1, create_max_wait=LONG) as node:
        orc = node.orchestrator
        first, _ = await orc.create(node.request(team_id="a"))
        order = {
            "a1": await _join(node, "a", 1),
            "a2": await _join(node, "a", 2),
            "b1": await _join(node, "b", 3),
            "b2": await _join(node, "b", 4),
        }
        waiting = orc.node.waiting
        assert waiting.positions("a") == [1, 3] and waiting.positions("b") == [2, 4]
        served: list[str] = []
        running: SandboxRecord = first
        for _ in order:
            await orc.kill(running.id)  # the one place frees: the next waiter takes it
            await eventually(lambda: sum(t.done() for t in order.values()) == len(served) + 1)
            name = next(n for n, t in order.items() if t.done() and n not in served)
            served.append(name)
            running, _ = order[name].result()
        assert served == ["a1", "b1", "a2", "b2"]
        assert waiting.stats.admitted == 4
        await _kill_all(node)


async def test_a_wait_that_runs_out_is_refused_with_the_reason(tmp_path: Path) -> None:
    async with double_node(tmp_path, max_sandboxes=1) as node:
        orc = node.orchestrator
        await orc.create(node.request())
        with pytest.raises(CapacityReached, match=r"maximum of 1 sandboxes .*waited 0.05 s"):
            await orc.create(node.request(wait=0.05))
        assert orc.node.waiting.stats.expired == 1
        await _kill_all(node)


async def test_a_wait_is_cut_to_the_node_maximum(tmp_path: Path) -> None:
    async with double_node(tmp_path, max_sandboxes=1, create_max_wait=0.05) as node:
        orc = node.orchestrator
        await orc.create(node.request())
        with pytest.raises(CapacityReached, match=r"waited 0.05 s"):
            await orc.create(node.request(wait=LONG))
        await _kill_all(node)


async def test_a_waiter_whose_client_leaves_leaves_the_queue(tmp_path: Path) -> None:
    async with double_node(tmp_path, max_sandboxes=1, create_max_wait=LONG) as node:
        orc = node.orchestrator
        running, _ = await orc.create(node.request())
        gone = await _join(node, "a", 1)
        kept = await _join(node, "b", 2)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert len(orc.node.waiting) == 1 and orc.node.waiting.stats.left == 1
        await orc.kill(running.id)
        record, _ = await kept  # the one left is served
        assert record.team_id == "b"
        await _kill_all(node)


async def test_a_full_queue_refuses_at_once(tmp_path: Path) -> None:
    async with double_node(
        tmp_path, max_sandboxes=1, create_max_wait=LONG, create_max_waiters=1
    ) as node:
        orc = node.orchestrator
        running, _ = await orc.create(node.request())
        waiter = await _join(node, "a", 1)
        with pytest.raises(CapacityReached, match="queue holds its maximum of 1"):
            await orc.create(node.request(team_id="b", wait=LONG))
        await orc.kill(running.id)
        await waiter
        await _kill_all(node)


async def test_a_key_at_its_cap_does_not_hold_up_another(tmp_path: Path) -> None:
    async with double_node(
        tmp_path, max_sandboxes=3, team_max_sandboxes=1, create_max_wait=LONG
    ) as node:
        orc = node.orchestrator
        mine, _ = await orc.create(node.request(team_id="a"))
        blocked = await _join(node, "a", 1)
        # The node has room: b's create passes a's waiter, which waits for its key's place.
        record, _ = await orc.create(node.request(team_id="b", wait=LONG))
        assert not blocked.done()
        await orc.kill(mine.id)
        second, _ = await blocked
        assert second.team_id == "a" and record.team_id == "b"
        await _kill_all(node)


async def test_fork_children_wait_for_room(tmp_path: Path) -> None:
    async with double_node(tmp_path, max_sandboxes=2, create_max_wait=LONG) as node:
        orc = node.orchestrator
        parent, _ = await orc.create(node.request())
        forking = asyncio.create_task(orc.fork(parent.id, 2, 60, wait=LONG))
        await eventually(lambda: len(orc.node.waiting) == 1, "one child waiting")
        await orc.kill(parent.id)
        children = await forking
        assert all(isinstance(c, SandboxRecord) for c in children), children
        await _kill_all(node)


async def test_a_waiter_whose_client_is_gone_leaves_the_queue(tmp_path: Path) -> None:
    async with double_node(tmp_path, max_sandboxes=1, create_max_wait=LONG) as node:
        orc = node.orchestrator
        running, _ = await orc.create(node.request())
        gone = asyncio.Event()
        waiter = asyncio.create_task(orc.create(node.request(wait=LONG, gone=gone)))
        await eventually(lambda: len(orc.node.waiting) == 1, "one waiting")
        gone.set()
        with pytest.raises(CapacityReached, match="the client went away"):
            await waiter
        assert len(orc.node.waiting) == 0 and orc.node.waiting.stats.left == 1
        await orc.kill(running.id)
        await eventually(lambda: not orc.list(), "the running one gone")
        assert orc.node.waiting.stats.admitted == 0  # nothing started for the one gone
        await _kill_all(node)


async def test_a_burst_past_capacity_completes_with_none_failing(tmp_path: Path) -> None:
    """40 creates from two keys on a node with room for 4, each killed once it runs: every
    create waits its turn and none is refused, and the queue is empty after."""
    async with double_node(tmp_path, max_sandboxes=4, create_max_wait=LONG) as node:
        orc = node.orchestrator
        burst = [
            asyncio.create_task(orc.create(node.request(team_id=f"key{i % 2}", wait=LONG)))
            for i in range(40)
        ]
        killed: set[str] = set()
        while not all(task.done() for task in burst):
            for record in orc.list():
                if record.id not in killed:
                    killed.add(record.id)
                    await orc.kill(record.id)
            await asyncio.sleep(0.01)
        results = [task.result()[0] for task in burst]  # raises any create's refusal
        assert len({r.id for r in results}) == 40
        assert orc.waiting.stats.expired == 0
        await _kill_all(node)


async def test_a_place_freed_while_a_waiter_is_refused_stays_its_turn() -> None:
    """Refused for the node's room, a waiter ends the round: the next owner is not tried until
    capacity changes, so a place freed between the two tries still goes to the first."""
    queue = WaitQueue()
    room = asyncio.Event()
    tried: list[str] = []

    def attempt(owner: str) -> Callable[[], Awaitable[str]]:
        async def run() -> str:
            tried.append(owner)
            if not room.is_set():
                raise CapacityReached("no room")
            room.clear()
            return owner

        return run

    a = asyncio.create_task(queue.admit("a", LONG, 10, attempt("a")))
    await eventually(lambda: tried == ["a"], "a tried")
    b = asyncio.create_task(queue.admit("b", LONG, 10, attempt("b")))
    await eventually(lambda: len(queue) == 2, "both waiting")
    # The newcomer started a round at "a" again: "b" is never tried while "a" is refused.
    await eventually(lambda: len(tried) >= 2, "a tried again")
    for _ in range(20):  # any turn given on would run within these loop turns
        await asyncio.sleep(0)
    assert tried == ["a", "a"]
    room.set()
    queue.changed()
    assert await a == "a" and not b.done()
    assert tried == ["a", "a", "a", "b"]  # b's turn came with the round after a's admission
    room.set()
    queue.changed()
    assert await b == "b"
