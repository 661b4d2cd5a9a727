"""The node's memory savers as `/metrics` reports them: the host's KSM merging and the node's
cold-memory reclaim (DAMON), read on each scrape. The server starts and stops them
(`runtime/ksm.py`, `runtime/damon.py`); the API reads their figures here, through the
orchestrator, never from the runtime itself."""

from __future__ import annotations

from dataclasses import dataclass, field

from aenv.runtime.damon import ColdReclaim, ReclaimStats
from aenv.runtime.ksm import Ksm, KsmStats


@dataclass(frozen=True)
class MemorySavers:
    # Host-wide: KSM merges the node's guests and anything else mergeable, whoever started it.
    ksm: Ksm = field(default_factory=Ksm)
    # None when `cold_reclaim_after` is off.
    cold_reclaim: ColdReclaim | None = None

    def ksm_stats(self) -> KsmStats | None:
        """KSM's figures; None when the kernel has none. Blocking: a few sysfs reads."""
        return self.ksm.stats() if self.ksm.available() else None

    def reclaim_stats(self) -> ReclaimStats | None:
        """What the node's reclaim scheme tried and paged out since it started; None when it is
        off. Blocking: a sysfs write (refresh) and a few reads."""
        return None if self.cold_reclaim is None else self.cold_reclaim.stats()
