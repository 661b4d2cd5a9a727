"""Who is told, as it happens, that a sandbox came to live on this node or left it: a cluster
node's agent, so gateways find a new sandbox at once rather than at the next heartbeat.

The orchestrator knows only this Protocol, never the cluster. A listener is best effort: the
heartbeat publishes the node's catalog as a whole anyway, so one that fails or is slow costs a
late route, never a failed create or kill.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

log = logging.getLogger("aenv.orchestrator")

# The longest a create or kill waits on its listeners; past it the heartbeat catches up.
LISTENER_DEADLINE = 1.0


class ResidencyListener(Protocol):
    async def sandbox_routed(self, sandbox_id: str) -> None:
        """The sandbox lives here now (created, forked)."""
        ...

    async def sandbox_gone(self, sandbox_id: str) -> None:
        """The sandbox no longer lives here (killed)."""
        ...


async def tell(
    listeners: Sequence[ResidencyListener],
    event: Callable[[ResidencyListener], Awaitable[None]],
    what: str,
) -> None:
    """Runs `event` on every listener, each within `LISTENER_DEADLINE`; never raises."""
    for listener in listeners:
        try:
            async with asyncio.timeout(LISTENER_DEADLINE):
                await event(listener)
        except Exception as error:  # best effort, see the module docstring
            log.warning("telling %r that %s failed: %r", listener, what, error)
