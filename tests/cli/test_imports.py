"""`aenv` commands that only talk to a node start without importing the node: its help and a
client command load neither the server, the orchestrator, the runtime nor the e2b SDK, which
are most of a second of CPU each time the command runs (scripts and tests run it often)."""

from __future__ import annotations

import json
import subprocess
import sys

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

# What each command is run with: every client command's group, and the whole command's help.
COMMANDS = [["--help"], ["volumes", "--help"], ["template", "--help"], ["snapshot", "--help"]]

# Runs each command in process, one after the other, then names which of HEAVY were loaded.
_PROBE = """
import json, sys
from aenv.cli.main import app
heavy, commands = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for command in commands:
    try:
        app(command, prog_name="aenv")
    except SystemExit:
        pass
print(json.dumps([m for m in heavy if m in sys.modules]), file=sys.stderr)
"""


def test_commands_talking_to_a_node_load_nothing_of_the_node() -> None:
    """One process for all of them: a module one loads would stay loaded, so each is seen."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(HEAVY), json.dumps(COMMANDS)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.count("Usage") == len(COMMANDS)
    assert json.loads(done.stderr.strip().splitlines()[-1]) == []
