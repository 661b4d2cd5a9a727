"""The SDK suites under `inner/`, `restart/`, `old_sdk/` (launched by test_server.py),
`network/` (by test_network.py), `volumes/` (by test_volumes.py) and `first_contact/` (by
test_first_contact.py) run inside the server's namespace."""

from typing import Any

from tests.e2e.timings import STAGES

collect_ignore = ["inner", "restart", "old_sdk", "network", "volumes", "first_contact"]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if STAGES:
        terminalreporter.section("end-to-end stages (wall time, then their slowest tests)")
        for stage in STAGES:
            terminalreporter.write_line(stage)
