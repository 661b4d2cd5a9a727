"""A gateway's creates waiting for a slot of their API key's limit of sandboxes at once
(`aenv.cluster.quota`), when their client asked to wait (`X-Aenv-Wait`).

A create holds its key's slot from the gateway to the node's answer, its wait at the node
included, so a burst of one key larger than its limit would have the creates past it refused
at once although each would get its slot as the first ones end. Those wait here instead, in
the node's kind of queue (`aenv.orchestrator.waiting`: first come, first served within a key,
round robin across keys). A slot frees when a create through this gateway ends (its
reservation is released, and its sandbox is counted on its node) or a sandbox is killed or
paused; both wake the queue at once. Slots freed elsewhere (another gateway, a timeout on a
node) are seen by a recheck every `RECHECK_S` while anyone waits: no signal crosses
gateways.
"""

from __future__ import annotations

import asyncio

from aenv.cluster.quota import KeyLimitReached, KeyQuota
from aenv.orchestrator.errors import CapacityReached
from aenv.orchestrator.waiting import WaitQueue

RECHECK_S = 1.0
# Creates waiting here at once; one more asking to wait is refused at once (the node's
# `create_max_waiters` is the same bound for its own queue).
MAX_WAITERS = 10_000


class KeySlots:
    def __init__(self, quota: KeyQuota, limit: int, holder: str = "this API key") -> None:
        """`holder`: what the refusal says holds the limit (the key's slots, or a team's)."""
        self.quota = quota
        self.limit = limit
        self.holder = holder
        self.waiting = WaitQueue()
        self._recheck: asyncio.Task[None] | None = None

    async def reserve(self, key_id: str, wait: float) -> str:
        """A slot of `key_id`'s limit, waiting up to `wait` seconds for one: the reservation's
        token. Raises `KeyLimitReached` when there is none in time, `ClusterUnavailable`."""

        async def attempt() -> str:
            try:
                return await self.quota.reserve(key_id, self.limit, self.holder)
            except KeyLimitReached as error:
                raise CapacityReached(str(error)) from error

        if wait > 0:
            self._keep_rechecking()
        try:
            return await self.waiting.admit(key_id, wait, MAX_WAITERS, attempt)
        except CapacityReached as error:
            raise KeyLimitReached(str(error)) from error

    async def release(self, key_id: str, token: str) -> None:
        """The reservation's create is over: its slot may go to a waiter."""
        try:
            await self.quota.release(key_id, token)
        finally:
            self.freed()

    def freed(self) -> None:
        """A slot may have freed (a sandbox killed or paused through this gateway)."""
        self.waiting.changed()

    def _keep_rechecking(self) -> None:
        if self._recheck is None or self._recheck.done():
            self._recheck = asyncio.create_task(self._rechecking())

    async def _rechecking(self) -> None:
        while len(self.waiting):
            await asyncio.sleep(RECHECK_S)
            self.waiting.changed()
