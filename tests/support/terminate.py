"""SIGTERM ends a test run the way Ctrl-C does: pytest stops at the test it is in and runs the
teardown of every fixture and the `finally` of the code under way, so servers, VMs, network
namespaces and mounts a run made go with it. Python's default is to exit at once, which left
an e2e server, its slots and the simulated internet running after a `kill` of the run."""

from __future__ import annotations

import signal
from types import FrameType


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
