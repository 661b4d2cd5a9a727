"""Creates that wait for capacity instead of being refused: the queue of waiters, served
fairly across owners (round robin over teams, FIFO within one team), woken when capacity
may have freed rather than by polling.

Only one waiter tries admission at a time (it holds the turn), so a freed place goes to the
waiter whose turn it is, not to whichever wakes first. A round offers the turn to the first
waiter of each owner in rotation order:
1. A waiter admitted leaves the queue, its owner moves to the end of the rotation, and a new
   round starts at once (more may fit).
2. A waiter refused for its own team's limit keeps its place and the turn passes to the next
   owner's first waiter (another team may be under its cap).
3. A waiter refused for the node's room keeps its place and the round ends: the next owner
   would be refused too, or would take a place freed between the two tries that was this
   owner's turn. So does a round where all were refused. The next round starts when
   capacity changes (`changed`), at the same waiter.
A waiter whose wait runs out, or whose client leaves (its task cancelled), leaves the queue
and passes the turn on if it held it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from aenv.orchestrator.errors import CapacityReached, OwnerLimitReached

T = TypeVar("T")


@dataclass(eq=False)
class Waiter:
    owner: str | None
    turn: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class WaitStats:
    """Counters for monitoring (the API exports them)."""

    admitted: int = 0  # waiters admitted after waiting
    expired: int = 0  # waits that ran out (answered 429)
    left: int = 0  # waiters whose client went away


class WaitQueue:
    """Waiters for capacity, by owner; the dict's order is the rotation."""

    def __init__(self) -> None:
        self._owners: dict[str | None, collections.deque[Waiter]] = {}
        self._round: collections.deque[Waiter] = collections.deque()
        self._holder: Waiter | None = None
        # Capacity changed during a round: a refusal in it may be stale, so run another.
        self._again = False
        self.stats = WaitStats()

    def __len__(self) -> int:
        return sum(len(q) for q in self._owners.values())

    def positions(self, owner: str | None) -> list[int]:
        """Where each of `owner`'s waiters stands (1 is next) in the order the rotation
        serves the whole queue, assuming every waiter ahead fits."""
        mine = self._owners.get(owner)
        if not mine:
            return []
        order = list(self._owners)
        rank = order.index(owner)
        found = []
        for i in range(len(mine)):
            ahead = i + sum(
                min(len(self._owners[o]), i + (1 if r < rank else 0))
                for r, o in enumerate(order)
                if o != owner
            )
            found.append(ahead + 1)
        return found

    async def admit(
        self,
        owner: str | None,
        wait: float,
        max_waiters: int,
        attempt: Callable[[], Awaitable[T]],
        gone: asyncio.Event | None = None,
    ) -> T:
        """`attempt()` (which raises CapacityReached when there is no room) when the node has
        room, waiting up to `wait` seconds in the queue for it. Raises the last refusal, its
        wait added, when the wait runs out, and CapacityReached when `gone` is set first (the
        client went away); nothing of the waiter is left then. Returns with no await after
        `attempt` succeeded, so the caller counts what it took at once."""
        if wait <= 0:
            return await attempt()
        if len(self) >= max_waiters:
            raise CapacityReached(f"no room now, and the queue holds its maximum of {max_waiters}")
        waiter = Waiter(owner)
        self._owners.setdefault(owner, collections.deque()).append(waiter)
        self.changed()  # a newcomer is tried in the next round
        refusal = "no room"
        try:
            async with asyncio.timeout(wait):
                while True:
                    await _first(waiter.turn, gone)
                    if gone is not None and gone.is_set():
                        self.stats.left += 1
                        raise CapacityReached("left the queue: the client went away")
                    waiter.turn.clear()
                    try:
                        result = await attempt()
                    except OwnerLimitReached as e:
                        refusal = str(e)
                        self._pass()
                        continue
                    except CapacityReached as e:
                        refusal = str(e)
                        self._round.clear()
                        self._pass()
                        continue
                    self._served(waiter)
                    self.stats.admitted += 1
                    return result
        except TimeoutError:
            self.stats.expired += 1
            raise CapacityReached(f"{refusal} (waited {wait:g} s for room)") from None
        except asyncio.CancelledError:
            self.stats.left += 1
            raise
        finally:
            self._leave(waiter)

    def changed(self) -> None:
        """Capacity may have freed (or a waiter came): start a round, or note that the one
        under way must be followed by another."""
        if self._holder is not None or self._round:
            self._again = True
            return
        self._start()

    def _start(self) -> None:
        self._again = False
        self._round = collections.deque(q[0] for q in self._owners.values())
        self._pass()

    def _pass(self) -> None:
        """Give the turn to the next waiter of the round; end the round when none is left."""
        self._holder = None
        while self._round:
            waiter = self._round.popleft()
            if waiter in self._owners.get(waiter.owner, ()):
                self._holder = waiter
                waiter.turn.set()
                return
        if self._again and self._owners:
            self._start()

    def _served(self, waiter: Waiter) -> None:
        """Step 1: `waiter` is admitted; its owner goes to the end of the rotation."""
        queue = self._owners.pop(waiter.owner)
        queue.remove(waiter)
        if queue:
            self._owners[waiter.owner] = queue
        self._holder = None
        self._round.clear()
        if self._owners:
            self._start()

    def _leave(self, waiter: Waiter) -> None:
        queue = self._owners.get(waiter.owner)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._owners[waiter.owner]
        if self._holder is waiter:
            self._pass()


async def _first(turn: asyncio.Event, gone: asyncio.Event | None) -> None:
    """Until `turn` or `gone` is set."""
    if gone is None:
        await turn.wait()
        return
    waits = [asyncio.ensure_future(turn.wait()), asyncio.ensure_future(gone.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()
