"""`aenv node` as a user runs it: configuration problems are one clear line and exit code 2,
before anything starts (starting a full node boots VMs, which the membership tests cover on
doubles)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.shared import SECRET


def aenv_node(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AENV_")}
    environment |= {"AENV_HOME": str(home), **env}
    command = [sys.executable, "-m", "aenv.cli", "node", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=environment)


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ((), {"AENV_CLUSTER_SECRET": SECRET.value}, "redis_url (AENV_REDIS_URL) is required"),
        (("--redis-url", "redis://127.0.0.1:1"), {}, "cluster_secret (AENV_CLUSTER_SECRET)"),
        (
            ("--redis-url", "redis://127.0.0.1:1"),
            {"AENV_CLUSTER_SECRET": "short"},
            "cluster_secret: the cluster secret must be at least 16 characters",
        ),
        (
            ("--redis-url", "redis://127.0.0.1:1"),
            {"AENV_CLUSTER_SECRET": SECRET.value, "AENV_LEASE_TTL": "1"},
            "heartbeat_interval must be above 0 and below lease_ttl",
        ),
    ],
)
def test_configuration_errors_are_one_clear_line(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    result = aenv_node(tmp_path, *args, **env)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    # Nothing started: the data directory was not even created.
    assert not any(tmp_path.iterdir())
