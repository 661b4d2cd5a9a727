"""Shared by the server benchmarks (not a benchmark itself): the step timings the server logs
(`aenv.timing.Steps` lines such as `started sandbox … on VM …: slot 0, restore 120, /init 80
(total 200 ms)`), read from its log over one stretch of a run, as the median of each step.

`LogStretch` is opened before the operation (it remembers where the log ends) and read after
it, so the figures are those of that operation alone.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from pathlib import Path

# "<date> <time> <logger> <what>: <step> <ms>, <step> <ms> (total <ms> ms)"
_LINE = re.compile(r"^\S+ \S+ \S+ (?P<what>.+?): (?P<steps>.+) \(total (?P<total>[\d.]+) ms\)$")
_STEP = re.compile(r"(?P<name>[^,]+?) (?P<ms>[\d.]+)(?:, |$)")
# The old-style lines of a fork and of a changed-pages save, which carry their own figures.
_FORK = re.compile(
    r"fork of \S+: checkpoint (?P<checkpoint>\d+) ms, \d+ children (?P<children>\d+)"
)
_SAVED = re.compile(r"saved VM \S+: page map (?P<page_map>\d+) ms, stream (?P<stream>\d+) ms")


class LogStretch:
    def __init__(self, log: Path) -> None:
        self.log = log
        self.start = log.stat().st_size

    def lines(self) -> list[str]:
        with self.log.open("rb") as f:
            f.seek(self.start)
            return f.read().decode(errors="replace").splitlines()

    def steps(self, what: str) -> dict[str, float]:
        """Median ms of each step of the lines whose subject starts with `what` ("started
        sandbox", "restored VM", "resume of", "snapshot of VM", "checkpoint of"), and
        their count (`n`)."""
        found: dict[str, list[float]] = defaultdict(list)
        count = 0
        for line in self.lines():
            match = _LINE.match(line)
            if match is None or not match["what"].startswith(what):
                continue
            count += 1
            for step in _STEP.finditer(match["steps"]):
                found[step["name"]].append(float(step["ms"]))
            found["total"].append(float(match["total"]))
        return {"n": count, **{name: statistics.median(ms) for name, ms in found.items()}}

    def figures(self, pattern: re.Pattern[str]) -> dict[str, float]:
        """Median of each named group of `pattern` over the lines it matches, and their count."""
        found: dict[str, list[float]] = defaultdict(list)
        for line in self.lines():
            match = pattern.search(line)
            if match is not None:
                for name, value in match.groupdict().items():
                    found[name].append(float(value))
        count = max((len(v) for v in found.values()), default=0)
        return {"n": count, **{name: statistics.median(v) for name, v in found.items()}}

    def forks(self) -> dict[str, float]:
        return self.figures(_FORK)

    def saves(self) -> dict[str, float]:
        return self.figures(_SAVED)
