"""The Firecracker path end to end through the orchestrator (`fc_orchestrator_scenario.py`), run as
a child pytest inside a network namespace this test makes and removes.

A namespace of its own, rather than the host's: the node's slots add veths, an nft table and
forwarding to whatever namespace plays the host. A child process rather than this one: HTTP
clients keep threads (pyqwest's runtime) in the namespace they were started in, so a process
cannot change namespaces between tests.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.network import netns
from tests.runtime.firecracker import fc_orchestrator_scenario as scenario

REPO = Path(__file__).resolve().parents[3]
# Minutes of real envd starts, template builds and pauses, though no VM boots.
pytestmark = pytest.mark.slow


@pytest.fixture
def host_netns() -> Iterator[str]:
    if os.geteuid() != 0 or shutil.which("nft") is None:
        pytest.skip("network slots need root and nft")
    name = f"aenv-fct-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        netns.remove(name)


def test_firecracker_through_the_orchestrator(host_netns: str, tmp_path: Path) -> None:
    # nsenter, not `ip netns exec`: the latter remounts /sys, hiding the cgroup hierarchies.
    pytest_argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [
            *("nsenter", f"--net=/run/netns/{host_netns}", "--", *pytest_argv),
            *("--basetemp", str(tmp_path / "inner"), scenario.__file__),
        ],
        cwd=REPO,
        env={**os.environ, scenario.IN_NETNS: "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
