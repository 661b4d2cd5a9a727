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
from collections.abc import Collection
from ipaddress import IPv4Network
from typing import Any, Protocol, runtime_checkable

from aenv.network.addressing import SlotsExhausted
from aenv.network.config import NetworkConfig
from aenv.network.egress_proxy import EgressCounts
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

    @property
    def denied(self) -> tuple[IPv4Network, ...]:
        """The ranges no slot may reach (`reserved`), whatever its policy."""
        ...

    @property
    def host_netns(self) -> str | None:
        """The namespace playing the host, where egress proxies' tunnels are dialled from (None:
        this process's own)."""
        ...

    @property
    def egress_ca(self) -> bytes | None:
        """The certificate (PEM) of the node's egress CA, which guests with header rules trust;
        None when this node applies no header rules."""
        ...


@runtime_checkable
class SlotReclaimer(Protocol):
    async def reclaim_leaked(self, kept: Collection[Slot]) -> list[str]:
        """Destroy the slots handed out that nothing holds any more: neither in `kept` (the
        holder's long-lived slots) nor held by the task that acquired them, which is still
        running; and remove namespaces of ours that no slot stands for. Returns their names."""
        ...


class SlotPool:
    def __init__(self, config: NetworkConfig) -> None:
        self.config = config
        self.manager = SlotManager(config)
        self._ready: deque[Slot] = deque()
        # The task that acquired each slot handed out: the slot is its own until it hands it to
        # a long-lived holder (`kept` in `reclaim_leaked`) or releases it.
        self._holders: dict[int, asyncio.Task[Any]] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._refill: asyncio.Task[None] | None = None

    @property
    def denied(self) -> tuple[IPv4Network, ...]:
        return self.config.denied

    @property
    def host_netns(self) -> str | None:
        return self.config.host_netns

    @property
    def egress_counts(self) -> EgressCounts:
        return self.manager.egress_counts

    @property
    def egress_ca(self) -> bytes | None:
        return self.manager.egress_ca

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
            self._hold(slot)
        else:
            # Ready slots have the default egress and no lists; adjust only what differs.
            slot = self._ready.popleft()
            self._hold(slot)
            if verdict != self.config.egress:
                await self.manager.set_egress(slot, verdict)
            if policy is not None:
                await self.manager.set_policy(slot, policy)
        if len(self._ready) < self.config.pool_low:
            self._kick()
        return slot

    def _hold(self, slot: Slot) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._holders[slot.index] = task

    async def release(self, slot: Slot) -> None:
        await self.manager.destroy(slot)
        self._holders.pop(slot.index, None)

    async def reclaim_leaked(self, kept: Collection[Slot]) -> list[str]:
        """Implements `SlotReclaimer`."""
        kept_indices = {slot.index for slot in kept}
        ready = {slot.index for slot in self._ready}
        leaked = []
        for slot in self.manager.in_use():
            if slot.index in ready or slot.index in kept_indices:
                continue
            # No holder yet: being made for an acquire, or for the ready queue.
            holder = self._holders.get(slot.index)
            if holder is not None and holder.done():
                leaked.append(slot)
        for slot in leaked:
            await self.release(slot)
        names = [slot.netns for slot in leaked] + await self.manager.remove_strays()
        if names:
            log.warning("reclaimed %d leaked network slots: %s", len(names), ", ".join(names))
        return names

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
