"""A team's metrics over a time range, as E2B's `/teams/{teamID}/metrics` serves them: how many
of its sandboxes ran at once, and how many it started a second.

Both are read from the team's lifecycle events (`orchestrator.events`, kept
`events_retention_days`), so they survive restarts and need no sampler: a sandbox runs from its
created or resumed event to its paused or killed one. A sandbox whose first kept event ends a run
was running before the kept events begin, so it counts from their start. A range is cut into
`step` second buckets (`step_for`) that end at `end`; each point gives the sandboxes running at
its time and the starts (created events) of the bucket it ends, a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aenv.orchestrator.catalog import Catalog
from aenv.orchestrator.events import EventType

# The finest step, and the most points one answer holds (a day at five minutes).
MIN_STEP = 5
MAX_POINTS = 288

_STARTS = (EventType.CREATED.value, EventType.RESUMED.value)
_ENDS = (EventType.PAUSED.value, EventType.KILLED.value)


@dataclass(frozen=True)
class TeamPoint:
    at: int  # Unix seconds
    concurrent: int
    start_rate: float


def step_for(start: int, end: int) -> int:
    return max(MIN_STEP, math.ceil((end - start) / MAX_POINTS))


class TeamMetrics:
    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def _timeline(self, team_id: str, end: int) -> tuple[set[str], list[tuple[float, str, str]]]:
        """The sandboxes running before the kept events begin, and the events up to `end`:
        (time, type, sandbox id), oldest first."""
        kinds = (*_STARTS, *_ENDS)
        marks = ", ".join("?" for _ in kinds)
        rows = self.catalog.db.execute(
            "SELECT created_at, type, sandbox_id FROM events WHERE team_id = ?"  # noqa: S608
            f" AND created_at <= ? AND type IN ({marks}) ORDER BY seq",
            (team_id, end, *kinds),
        ).fetchall()
        seen: set[str] = set()
        before: set[str] = set()
        for _, kind, sandbox_id in rows:
            if sandbox_id not in seen and kind in _ENDS:
                before.add(sandbox_id)
            seen.add(sandbox_id)
        return before, [(float(at), str(kind), str(sid)) for at, kind, sid in rows]

    def series(self, team_id: str, start: int, end: int) -> list[TeamPoint]:
        """A point every `step_for(start, end)` seconds, the last at `end`, the first the
        earliest not before `start`."""
        step = step_for(start, end)
        running, events = self._timeline(team_id, end)
        points: list[TeamPoint] = []
        index = 0
        for at in range(end - (end - start) // step * step, end + 1, step):
            started = 0
            while index < len(events) and events[index][0] <= at:
                when, kind, sandbox_id = events[index]
                _apply(running, kind, sandbox_id)
                started += kind == EventType.CREATED.value and when > at - step
                index += 1
            points.append(TeamPoint(at, len(running), started / step))
        return points

    def max_concurrent(self, team_id: str, start: int, end: int) -> tuple[int, float]:
        """The most sandboxes of the team running at once between `start` and `end`, and when
        that was first reached."""
        return peak(*self.changes(team_id, start, end), start)

    def changes(self, team_id: str, start: int, end: int) -> tuple[int, list[tuple[float, int]]]:
        """The sandboxes of the team running at `start`, and each change of that count up to
        `end`: (time, +1 or -1), oldest first. A cluster's gateway merges the nodes' (`peak`)."""
        running, events = self._timeline(team_id, end)
        index = 0
        while index < len(events) and events[index][0] <= start:
            _apply(running, *events[index][1:])
            index += 1
        at_start = len(running)
        changes: list[tuple[float, int]] = []
        for when, kind, sandbox_id in events[index:]:
            before = len(running)
            _apply(running, kind, sandbox_id)
            if len(running) != before:
                changes.append((when, len(running) - before))
        return at_start, changes

    def max_start_rate(self, team_id: str, start: int, end: int) -> tuple[float, float]:
        """The highest start rate of a bucket between `start` and `end`, and its time."""
        points = self.series(team_id, start, end)
        top = max(points, key=lambda p: p.start_rate)
        return top.start_rate, float(top.at)


def peak(at_start: int, changes: list[tuple[float, int]], start: int) -> tuple[int, float]:
    """The highest count `changes` (oldest first) reach from `at_start` at `start`, and when it
    was first reached."""
    count, best, best_at = at_start, at_start, float(start)
    for when, change in changes:
        count += change
        if count > best:
            best, best_at = count, when
    return best, best_at


def _apply(running: set[str], kind: str, sandbox_id: str) -> None:
    if kind in _STARTS:
        running.add(sandbox_id)
    else:
        running.discard(sandbox_id)
