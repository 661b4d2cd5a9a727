"""Warm pools: per template, VMs already restored from its saved state but not yet given to a
sandbox, so that a create skips the restore and only runs envd `/init`.

This module keeps the books: which pooled VMs exist, how many each template wants, and the
counters the metrics export. The orchestrator starts, takes and stops the VMs. A pooled VM
already has the sandbox id it will carry: its directories are named by it from the restore
on, and a VMM cannot move its files while it runs. That id is shown nowhere until the take,
and the catalog has no row for it, so the API cannot list or count it.

The size a template wants is the number of its creates in the last `WINDOW` seconds (about the
creates the next refill has to cover), bounded by `max_per_template`. A template nobody
created from lately wants none, so an idle node holds no pooled VM and spends nothing on it.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field

from aenv.network import Slot
from aenv.runtime.driver import VM

# Seconds of create history that size a template's pool.
WINDOW = 60.0
# A marker in a pooled VM's sandbox directory: the start-up sweep removes such a directory
# when no catalog row names it (a server killed with VMs in its pools).
MARKER = "pooled"


@dataclass(eq=False)  # pools find and remove one by identity
class Pooled:
    """A restored VM waiting for a create, on a slot whose egress is closed."""

    sandbox_id: str
    template_id: str
    # The build it was restored from, and that build's files; a rebuild makes it stale.
    build_id: str
    snapshot_dir: str
    vm: VM
    slot: Slot
    memory_mb: int
    # Keeps its saved build from being collected while no catalog row names it.
    pin: ExitStack = field(default_factory=ExitStack)


@dataclass
class PoolCounters:
    """Per template, for monitoring."""

    hits: collections.Counter[str] = field(default_factory=collections.Counter)
    misses: collections.Counter[str] = field(default_factory=collections.Counter)
    refills: collections.Counter[str] = field(default_factory=collections.Counter)
    evictions: collections.Counter[str] = field(default_factory=collections.Counter)


class WarmPools:
    def __init__(self, max_per_template: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_per_template = max_per_template
        self.counters = PoolCounters()
        self._clock = clock
        self._ready: dict[str, collections.deque[Pooled]] = collections.defaultdict(
            collections.deque
        )
        self._filling: collections.Counter[str] = collections.Counter()
        self._creates: dict[str, collections.deque[float]] = collections.defaultdict(
            collections.deque
        )

    @property
    def enabled(self) -> bool:
        return self.max_per_template > 0

    def note_create(self, template_id: str) -> None:
        """A create from `template_id` asked for a VM (hit or miss): it sizes the pool."""
        self._creates[template_id].append(self._clock())

    def recent_creates(self, template_id: str) -> int:
        times = self._creates.get(template_id)
        if times is None:
            return 0
        horizon = self._clock() - WINDOW
        while times and times[0] < horizon:
            times.popleft()
        if not times:
            del self._creates[template_id]
        return len(times)

    def target(self, template_id: str) -> int:
        return min(self.max_per_template, self.recent_creates(template_id))

    def missing(self) -> list[str]:
        """Templates whose pool (ready and filling) is under its target, one entry per VM."""
        wanted = []
        for template_id in list(self._creates):
            held = len(self._ready.get(template_id, ())) + self._filling[template_id]
            wanted += [template_id] * max(0, self.target(template_id) - held)
        return wanted

    def surplus(self) -> list[Pooled]:
        """Pooled VMs beyond their template's target (its creates slowed down), taken out."""
        extra = []
        for template_id, ready in self._ready.items():
            while len(ready) > self.target(template_id):
                extra.append(ready.popleft())
                self.counters.evictions[template_id] += 1
        return extra

    def take(self, template_id: str, build_id: str) -> tuple[Pooled | None, list[Pooled]]:
        """The oldest pooled VM of the template's current build, if any, and the stale ones
        (of an older build) taken out on the way, for the caller to stop."""
        ready = self._ready.get(template_id)
        stale: list[Pooled] = []
        while ready:
            pooled = ready.popleft()
            if pooled.build_id == build_id:
                self.counters.hits[template_id] += 1
                return pooled, stale
            stale.append(pooled)
            self.counters.evictions[template_id] += 1
        self.counters.misses[template_id] += 1
        return None, stale

    def add(self, pooled: Pooled) -> None:
        self._ready[pooled.template_id].append(pooled)
        self.counters.refills[pooled.template_id] += 1

    @property
    def filling(self) -> collections.Counter[str]:
        """VMs being restored for each template (the refill counts them as held)."""
        return self._filling

    def evict(self, pooled: Pooled) -> None:
        """Take `pooled` out to give it back (memory pressure)."""
        self._ready[pooled.template_id].remove(pooled)
        self.counters.evictions[pooled.template_id] += 1

    def drain(self) -> list[Pooled]:
        """Every pooled VM, taken out (shutdown)."""
        out = [p for ready in self._ready.values() for p in ready]
        self._ready.clear()
        return out

    def sizes(self) -> dict[str, int]:
        return {t: len(r) for t, r in self._ready.items()}

    def __iter__(self) -> Iterator[Pooled]:
        return (p for ready in self._ready.values() for p in ready)
