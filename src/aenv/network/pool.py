"""The warm pool of ready network slots, and the interface the orchestrator uses.

Creating a slot takes milliseconds of netlink and nft work; handing out one that was created
earlier takes microseconds. The pool keeps up to `pool_high` ready slots and refills in the
background whenever an acquire leaves fewer than `pool_low`. An empty pool never fails an
acquire: it creates a slot on the spot. Released slots are destroyed, never handed out again: a
used slot carries its guest's conntrack, neighbour and nft state, and a fresh one is cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Protocol

from aenv.network.addressing import SlotsExhausted
from aenv.network.config import NetworkConfig
from aenv.network.manager import SlotManager
from aenv.network.policy import EgressPolicy
from aenv.network.slot import Slot

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 30.0


class SlotProvider(Protocol):
    async def acquire(
        self, *, egress: bool | None = None, policy: EgressPolicy | None = None
    ) -> Slot:
        """A ready slot; `egress` None means the configured default, `policy` None no lists."""
        ...

    async def release(self, slot: Slot) -> None: ...

    async def set_egress(self, slot: Slot, enabled: bool) -> None: ...

    async def set_policy(self, slot: Slot, policy: EgressPolicy) -> None: ...


class SlotPool:
    def __init__(self, config: NetworkConfig) -> None:
        self.config = config
        self.manager = SlotManager(config)
        self._ready: deque[Slot] = deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._refill: asyncio.Task[None] | None = None

    @property
    def ready(self) -> int:
        return len(self._ready)

    @property
    def in_use(self) -> int:
        return self.manager.live - len(self._ready)

    async def start(self) -> None:
        """Reclaim leftovers of a previous process, prepare the host, start filling the pool."""
        await self.manager.start()
        self._refill = asyncio.create_task(self._refill_loop(), name="network-slot-refill")
        self._kick()

    async def wait_idle(self) -> None:
        """Return once the background refill has nothing left to do (the pool is at its high
        watermark, or no more slots can be made)."""
        await self._idle.wait()

    def _kick(self) -> None:
        # Cleared here, not in the refill task, so `wait_idle` right after a kick waits.
        self._idle.clear()
        self._wake.set()

    async def acquire(
        self, *, egress: bool | None = None, policy: EgressPolicy | None = None
    ) -> Slot:
        verdict = self.config.egress if egress is None else egress
        if not self._ready:
            slot = await self.manager.create(egress=verdict, policy=policy)
        else:
            # Ready slots have the default egress and no lists; adjust only what differs.
            slot = self._ready.popleft()
            if verdict != self.config.egress:
                await self.manager.set_egress(slot, verdict)
            if policy is not None:
                await self.manager.set_policy(slot, policy)
        if len(self._ready) < self.config.pool_low:
            self._kick()
        return slot

    async def release(self, slot: Slot) -> None:
        await self.manager.destroy(slot)

    async def set_egress(self, slot: Slot, enabled: bool) -> None:
        await self.manager.set_egress(slot, enabled)

    async def set_policy(self, slot: Slot, policy: EgressPolicy) -> None:
        await self.manager.set_policy(slot, policy)

    async def close(self) -> None:
        """Stop refilling and destroy every slot, ready or in use, and the host table."""
        if self._refill is not None:
            self._refill.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refill
        self._ready.clear()
        await self.manager.close()

    async def _refill_loop(self) -> None:
        failures = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            while len(self._ready) < self.config.pool_high:
                try:
                    slot = await self.manager.create()
                except SlotsExhausted:
                    break
                except Exception:
                    failures += 1
                    delay = min(_MAX_BACKOFF_S, 0.1 * 2**failures)
                    log.exception("creating a network slot failed; retrying in %.1f s", delay)
                    await asyncio.sleep(delay)
                    continue
                failures = 0
                self._ready.append(slot)
            if not self._wake.is_set():
                self._idle.set()
