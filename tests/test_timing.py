"""The step timings the server logs (`aenv.timing.Steps`): bench/server_steps.py reads these
lines back, so their shape is part of the contract. A stepped clock stands in for time."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from aenv.timing import Steps


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Seconds that `perf_counter` returns, one per call, in order."""
    readings: list[float] = []
    values: Iterator[float] = iter(readings)
    monkeypatch.setattr(time, "perf_counter", lambda: next(values))
    return readings


def test_steps_time_each_mark_from_the_previous_one(clock: list[float]) -> None:
    clock += [10.0, 10.020, 10.021, 10.030, 10.045, 10.047]
    steps = Steps()  # 10.000
    steps.mark("first")  # 10.020
    steps.mark("second")  # 10.021
    inner = Steps()  # 10.030
    inner.mark("deep")  # 10.045
    steps.add(inner, prefix="inner ")
    steps.mark("after")  # 10.047: from the inner step's end, not counted twice
    assert [(name, round(ms)) for name, ms in steps.parts] == [
        ("first", 20),
        ("second", 1),
        ("inner deep", 15),
        ("after", 2),
    ]
    assert round(steps.total_ms()) == 47


def test_the_logged_line_names_every_step_and_the_total(clock: list[float]) -> None:
    clock += [0.0, 0.004, 0.1294]
    steps = Steps()
    steps.mark("slot")
    steps.mark("/init")
    assert str(steps) == "slot 4, /init 125 (total 129 ms)"
    assert re.fullmatch(r"(?:[^,]+ \d+, )*[^,]+ \d+ \(total \d+ ms\)", str(steps))
