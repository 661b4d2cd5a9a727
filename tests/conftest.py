"""Where a run's minutes went, by test directory: printed at the end of `make test`, so a CI
log (of which only the end may be kept) shows which suites to look at when it grows."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

_SECONDS: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SECONDS[report.nodeid.split("::")[0].rsplit("/", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if sum(_SECONDS.values()) < 60:
        return
    terminalreporter.section("time by test directory (setup, call and teardown)")
    for directory, seconds in sorted(_SECONDS.items(), key=lambda item: -item[1])[:20]:
        terminalreporter.write_line(f"{seconds:8.1f}s {directory}")
