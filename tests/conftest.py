"""Where a run's minutes went, by test directory: printed at the end of `make test`, so a CI
log (of which only the end may be kept) shows which suites to look at when it grows. Next to
the wall time, the CPU time of this pytest process and of the processes it reaped (servers,
VMMs, CLI calls; each counts its own reaped descendants): on a host whose cores are all busy,
CPU is what a suite takes from the others. Under pytest-xdist each test's CPU travels with its
report from the worker that ran it."""

from __future__ import annotations

import resource
from collections import defaultdict
from collections.abc import Generator, Iterator
from typing import Any, cast

import pytest

pytest_plugins = ["tests.support.terminate", "tests.support.rewrite_cache"]

_SECONDS: defaultdict[str, float] = defaultdict(float)
_CPU: defaultdict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
_START = pytest.StashKey[tuple[float, float]]()
_CPU_PROPERTY = "cpu seconds (own, reaped)"


def _directory(nodeid: str) -> str:
    return nodeid.split("::")[0].rsplit("/", 1)[0]


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    item.stash[_START] = _cpu()
    yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if call.when == "teardown":
        (own, reaped), (own_after, reaped_after) = item.stash[_START], _cpu()
        report.user_properties.append((_CPU_PROPERTY, (own_after - own, reaped_after - reaped)))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    directory = _directory(report.nodeid)
    _SECONDS[directory] += report.duration
    for name, value in report.user_properties:
        if name == _CPU_PROPERTY:
            own, reaped = cast("tuple[float, float]", value)
            spent = _CPU[directory]
            spent[0] += own
            spent[1] += reaped


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if sum(_SECONDS.values()) < 60:
        return
    terminalreporter.section("time by test directory (wall; CPU of pytest, of what it reaped)")
    for directory, seconds in sorted(_SECONDS.items(), key=lambda item: -item[1])[:20]:
        own, reaped = _CPU[directory]
        terminalreporter.write_line(f"{seconds:8.1f}s {own:8.1f}s {reaped:8.1f}s {directory}")
