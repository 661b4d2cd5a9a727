"""How long each stage of the end-to-end server suites took, and their slowest tests: printed at
the end of `make test` (tests/e2e/conftest.py), so a CI log shows where its minutes went."""

from __future__ import annotations

import re

STAGES: list[str] = []

_SLOWEST = re.compile(r"^=+ slowest .*durations =+$")


def record(stage: str, seconds: float, output: str) -> None:
    """A stage's wall time and the slowest-tests lines of its child pytest's `output`."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if _SLOWEST.match(line)), None)
    slowest = []
    if start is not None:
        for line in lines[start + 1 :]:
            if not line.strip() or line.startswith("=") or line.startswith("("):
                break
            slowest.append(f"      {line}")
    STAGES.append("\n".join([f"{seconds:8.1f}s {stage}", *slowest]))
