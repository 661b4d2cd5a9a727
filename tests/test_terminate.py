"""A SIGTERM to a test run still runs the teardown of what the running test set up
(tests/support/terminate.py): a child pytest is stopped in the middle of a test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHILD_TEST = """
import time
from pathlib import Path

import pytest

@pytest.fixture
def made():
    Path("set-up").touch()
    yield
    Path("torn-down").touch()

def test_runs_long(made):
    time.sleep(120)
"""


def test_sigterm_runs_the_teardown(tmp_path: Path) -> None:
    (tmp_path / "test_child.py").write_text(CHILD_TEST)
    child = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-p", "tests.support.terminate", "test_child.py"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "set-up").exists():
            assert child.poll() is None and time.monotonic() < deadline, child.stdout
            time.sleep(0.05)
        child.send_signal(signal.SIGTERM)
        output, _ = child.communicate(timeout=60)
    finally:
        child.kill()
        child.wait()
    assert (tmp_path / "torn-down").exists(), output.decode()
    assert child.returncode == 2  # pytest's "interrupted"
