"""Wheels of the code interpreter server's own requirements (no data stack), for VM tests
whose server namespace has no route to PyPI: downloaded once from here with the host's pip into
build/ (gitignored). The guest's Python is Debian bookworm's 3.11, as the test machines' is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]
WHEELS = PROJECT / "build" / "code-interpreter-wheels"
SERVER_REQUIREMENTS = ("jupyter_client>=8.6,<9", "ipykernel>=6.29,<8", "starlette>=0.47,<2",
                       "uvicorn>=0.30,<1", "pydantic>=2.7,<3")  # fmt: skip


def ensure_code_interpreter_wheels() -> Path:
    stamp = WHEELS / ".complete"
    if not stamp.exists():
        WHEELS.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
             "--python-version", "3.11", "-d", str(WHEELS), *SERVER_REQUIREMENTS],
            check=True,
            timeout=600,
        )  # fmt: skip
        stamp.touch()
    return WHEELS
