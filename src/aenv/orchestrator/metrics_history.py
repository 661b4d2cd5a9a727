"""Each sandbox's resource samples over time (envd's CPU, memory and disk figures), taken at a
fixed interval while it runs and kept for a bounded retention, through pauses and resumes, until
the sandbox is gone. In memory: a restart of the server starts the history afresh.

Bounded: at most `retention / interval` samples per sandbox (720 of about 150 bytes each with
the defaults), and the sampler asks at most `CONCURRENCY` guests at once.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Collection
from dataclasses import dataclass

INTERVAL = 5.0  # seconds between two samples of a running sandbox
RETENTION = 3600.0  # seconds a sample is kept
CONCURRENCY = 16


@dataclass(frozen=True)
class Sample:
    ts: float  # Unix seconds on the host when taken (a guest's clock may lag after a restore)
    values: dict[str, float]


class MetricsHistory:
    def __init__(self, interval: float = INTERVAL, retention: float = RETENTION) -> None:
        self.interval = interval
        self.retention = retention
        self._samples: dict[str, collections.deque[Sample]] = {}

    def add(self, sandbox_id: str, values: dict[str, float]) -> Sample:
        sample = Sample(time.time(), values)
        kept = self._samples.setdefault(
            sandbox_id, collections.deque(maxlen=max(1, int(self.retention / self.interval)))
        )
        kept.append(sample)
        while kept and kept[0].ts < sample.ts - self.retention:
            kept.popleft()
        return sample

    def between(self, sandbox_id: str, start: float, end: float) -> list[Sample]:
        """The samples from `start` to `end` (Unix seconds, inclusive), oldest first."""
        return [s for s in self._samples.get(sandbox_id, ()) if start <= s.ts <= end]

    def latest(self, sandbox_id: str) -> Sample | None:
        kept = self._samples.get(sandbox_id)
        return kept[-1] if kept else None

    def keep_only(self, sandbox_ids: Collection[str]) -> None:
        """Forget the sandboxes not among `sandbox_ids` (killed since)."""
        for gone in set(self._samples) - set(sandbox_ids):
            del self._samples[gone]
