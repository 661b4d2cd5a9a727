"""Runs inside the namespace of a node started with its defaults (test_first_contact.py), as a
user on its host would: the environment `aenv auth` prints, nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.http_wait import wait_until_up

PORT = 3000


def aenv(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aenv.cli", *argv],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


@pytest.fixture(scope="session", autouse=True)
def node() -> Iterator[dict[str, str]]:
    """The node up, and `eval "$(aenv auth)"` applied to this process's environment."""
    home = Path(os.environ["AENV_HOME"])
    if not wait_until_up(f"http://127.0.0.1:{PORT}/health", 1200):
        pytest.fail("node did not come up:\n" + (home / "server.log").read_text()[-5000:])
    auth = aenv("auth")
    assert auth.returncode == 0, auth.stderr
    exported = dict(line.removeprefix("export ").split("=", 1) for line in auth.stdout.splitlines())
    os.environ.update(exported)
    yield exported
