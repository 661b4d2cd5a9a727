"""Where a run's minutes went, by test directory: printed at the end of `make test`, so a CI
log (of which only the end may be kept) shows which suites to look at when it grows. Next to
the wall time, the CPU time of this pytest process and of the processes it reaped (servers,
VMMs, CLI calls; each counts its own reaped descendants): on a host whose cores are all busy,
CPU is what a suite takes from the others."""

from __future__ import annotations

import resource
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

pytest_plugins = ["tests.support.terminate"]

_SECONDS: defaultdict[str, float] = defaultdict(float)
_CPU: defaultdict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])


def _directory(nodeid: str) -> str:
    return nodeid.split("::")[0].rsplit("/", 1)[0]


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    own, reaped = _cpu()
    yield
    own_after, reaped_after = _cpu()
    spent = _CPU[_directory(item.nodeid)]
    spent[0] += own_after - own
    spent[1] += reaped_after - reaped


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SECONDS[_directory(report.nodeid)] += report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if sum(_SECONDS.values()) < 60:
        return
    terminalreporter.section("time by test directory (wall; CPU of pytest, of what it reaped)")
    for directory, seconds in sorted(_SECONDS.items(), key=lambda item: -item[1])[:20]:
        own, reaped = _CPU[directory]
        terminalreporter.write_line(f"{seconds:8.1f}s {own:8.1f}s {reaped:8.1f}s {directory}")
