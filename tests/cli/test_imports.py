"""`aenv` commands that only talk to a node start without importing the node: its help and a
client command load neither the server, the orchestrator, the runtime nor the e2b SDK, which
are most of a second of CPU each time the command runs (scripts and tests run it often)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# What only `aenv server`, `aenv node`, `aenv doctor`, `template build` and `reset` need.
HEAVY = [
    "aenv.server",
    "aenv.orchestrator.lifecycle",
    "aenv.runtime.driver",
    "aenv.network",
    "aenv.doctor",
    "aenv.api.app",
    "uvicorn",
    "e2b",
]

# Runs the command in process, then names which of HEAVY it had loaded.
_PROBE = """
import json, sys
from aenv.cli.main import app
try:
    app(sys.argv[2:], prog_name="aenv")
except SystemExit:
    pass
print(json.dumps([m for m in json.loads(sys.argv[1]) if m in sys.modules]), file=sys.stderr)
"""


@pytest.mark.parametrize(
    "command",
    [["--help"], ["volumes", "--help"], ["template", "--help"], ["snapshot", "--help"]],
    ids=" ".join,
)
def test_a_command_talking_to_a_node_loads_nothing_of_the_node(command: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(HEAVY), *command],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "Usage" in done.stdout
    assert json.loads(done.stderr.strip().splitlines()[-1]) == []
