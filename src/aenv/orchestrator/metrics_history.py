"""Each sandbox's resource samples over time, taken at a fixed interval while it runs and kept
for a bounded retention, through pauses and resumes, until the sandbox is gone. In memory: a
restart of the server starts the history afresh.

What a sample holds, and where each figure comes from:
- `cpu_used_pct`: from the host, every interval: the CPU time the sandbox's VMM used since the
  previous reading (or since it started), as a share of the guest's vCPUs, at most 100. It
  counts what the guest ran and what the VMM spent running it: under emulation (TCG) an idle
  guest shows a fraction of a percent, under KVM it is the guest's own use give or take.
- the guest's figures (`cpu_count`, memory, disk): from envd, asked only when the guest did work
  since the previous round (its VMM used more than `busy_cores`), when the newest ones are older
  than `guest_interval`, or when there are none yet; otherwise a sample repeats the newest. An
  idle guest's memory and disk do not move, and asking costs it an HTTP request served on its
  own (emulated) CPU: about 10 ms of host CPU under TCG, a fifth of what an idle sandbox costs
  when asked every interval (docs/density.md). So a sample's guest figures are at most
  `guest_interval` old, and fresh whenever the guest was busy.

Bounded: at most `retention / interval` samples per sandbox (720 of about 150 bytes each with
the defaults), and the sampler asks at most `CONCURRENCY` guests at once.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Collection
from dataclasses import dataclass

from aenv.runtime.driver import CPUTime

INTERVAL = 5.0  # seconds between two samples of a running sandbox
RETENTION = 3600.0  # seconds a sample is kept
GUEST_INTERVAL = 60.0  # seconds an idle guest's own figures are reused before asking again
# Share of one core above which a VMM's use since the previous reading means its guest did work.
# An idle guest's VMM uses 0.005-0.009 under TCG, plus 0.002 for a guest sample in the interval.
BUSY_CORES = 0.02
CONCURRENCY = 16


@dataclass(frozen=True)
class Sample:
    ts: float  # Unix seconds on the host when taken (a guest's clock may lag after a restore)
    values: dict[str, float]


@dataclass(frozen=True)
class _Reading:
    cpu: CPUTime
    at: float  # Unix seconds on the host


@dataclass(frozen=True)
class _GuestFigures:
    values: dict[str, float]
    at: float


class MetricsHistory:
    def __init__(
        self,
        interval: float = INTERVAL,
        retention: float = RETENTION,
        guest_interval: float = GUEST_INTERVAL,
        busy_cores: float = BUSY_CORES,
    ) -> None:
        self.interval = interval
        self.retention = retention
        self.guest_interval = guest_interval
        self.busy_cores = busy_cores
        self._samples: dict[str, collections.deque[Sample]] = {}
        self._readings: dict[str, _Reading] = {}
        self._guest: dict[str, _GuestFigures] = {}

    def needs_guest(self, sandbox_id: str, cpu: CPUTime) -> bool:
        """Whether a sample with this VMM reading must ask the guest for its figures: none
        yet, the newest older than `guest_interval`, or the guest busy since the last reading."""
        now = time.time()
        figures = self._guest.get(sandbox_id)
        if figures is None or now - figures.at >= self.guest_interval:
            return True
        return self._cores_since(sandbox_id, cpu, now) > self.busy_cores

    def record(self, sandbox_id: str, cpu: CPUTime, guest: dict[str, float] | None) -> Sample:
        """Add a sample from a VMM reading and the guest's figures, `None` meaning the newest
        ones still hold (`needs_guest` said so: there are some)."""
        now = time.time()
        if guest is not None:
            self._guest[sandbox_id] = _GuestFigures(guest, now)
        figures = self._guest[sandbox_id].values
        vcpus = max(1.0, figures.get("cpu_count", 1.0))
        used = min(100.0, 100.0 * self._cores_since(sandbox_id, cpu, now) / vcpus)
        self._readings[sandbox_id] = _Reading(cpu, now)
        return self.add(sandbox_id, figures | {"cpu_used_pct": round(used, 2)}, now)

    def _cores_since(self, sandbox_id: str, cpu: CPUTime, now: float) -> float:
        """Cores the VMM used on average since the previous reading of the same VMM process,
        or since it started."""
        last = self._readings.get(sandbox_id)
        if last is None or last.cpu.started != cpu.started:
            last = _Reading(CPUTime(0.0, cpu.started), cpu.started)
        return max(0.0, cpu.seconds - last.cpu.seconds) / max(now - last.at, 1e-3)

    def add(self, sandbox_id: str, values: dict[str, float], ts: float | None = None) -> Sample:
        sample = Sample(time.time() if ts is None else ts, values)
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
        keep = set(sandbox_ids)
        for kept in (self._samples, self._readings, self._guest):
            for gone in set(kept) - keep:
                del kept[gone]
