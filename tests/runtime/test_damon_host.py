"""Cold reclaim on this very host, read only: the probe says exactly why it cannot run here,
checked against what the host shows by other means (`swapon`, the kdamonds' own files), and a
server asked for `cold_reclaim_after` refuses to start with that message, before it makes
anything; the node finds its own VMM processes (stopped QEMUs, no guest) and their memory
cgroups, what its kdamond would target. Nothing under /sys/kernel/mm/damon is written: the
host's kdamond stays as it is."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from aenv.config import Paths
from aenv.runtime.damon import SYSFS, VmmTarget, memcg_of, node_targets, probe
from tests.runtime.test_sweep import _running, start_qemu
from tests.support.ports import free_port


def _kdamonds_state() -> list[tuple[str, str, str]]:
    """Each kdamond's state and pid, and how many there are: what a write would change."""
    if not SYSFS.is_dir():
        return []
    count = (SYSFS / "kdamonds/nr_kdamonds").read_text().strip()
    return [("nr", count, "")] + [
        (d.name, (d / "state").read_text().strip(), (d / "pid").read_text().strip())
        for d in sorted(SYSFS.glob("kdamonds/[0-9]*"))
    ]


def _swap_devices() -> list[str]:
    if shutil.which("swapon") is None:
        pytest.skip("no swapon to check the probe against")
    shown = subprocess.run(
        ["swapon", "--show=NAME", "--noheadings"], capture_output=True, text=True, check=True
    )
    return shown.stdout.split()


def test_the_probe_says_exactly_why_this_host_cannot_reclaim() -> None:
    before = _kdamonds_state()
    facts = probe()
    assert _kdamonds_state() == before  # read only
    reasons = facts.refusals()
    said = "; ".join(reasons)
    assert ("cold reclaim needs swap" in said) == (not _swap_devices())
    if not SYSFS.is_dir():
        assert "this kernel has no DAMON sysfs interface (CONFIG_DAMON_SYSFS)" in reasons
        return
    for index, state, pid in before[1:]:
        if state == "on":
            assert f"another DAMON user's kdamond {index} (pid {pid}) is running" in said
    contexts = sorted(SYSFS.glob("kdamonds/*/contexts/*/avail_operations"))
    if contexts:
        avail = contexts[0].read_text().split()
        why = facts.choice()[1]
        assert ("no vaddr operations (CONFIG_DAMON_VADDR)" in why) == ("vaddr" not in avail)


def test_a_server_asked_for_cold_reclaim_refuses_to_start_here(tmp_path: Path) -> None:
    reasons = probe().refusals()
    if not reasons:
        pytest.skip("this host could run cold reclaim: the refusal needs one that cannot")
    before = _kdamonds_state()
    home = tmp_path / "home"
    env = {
        **os.environ,
        "AENV_HOME": str(home),
        "AENV_COLD_RECLAIM_AFTER": "600",
        "AENV_PUBLISH_CODE_INTERPRETER": "false",
        "COLUMNS": "400",  # one line per message
    }
    port = str(free_port())
    server = subprocess.run(
        [sys.executable, "-m", "aenv.cli", "server", "--host", "127.0.0.1", "--port", port],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # keeps a broken start from hanging the suite; nothing is timed
    )
    said = " ".join((server.stdout + server.stderr).split())  # rich wraps long lines
    assert server.returncode == 2, said
    assert "configuration error: cold_reclaim_after = 600 cannot be honoured here" in said
    for reason in reasons:
        assert " ".join(reason.split()) in said
    assert "Traceback" not in said
    # Refused before anything was made: no data directory, no guest memory directory.
    assert not home.exists()
    assert not Paths(home).memory.exists()
    assert _kdamonds_state() == before


def test_the_node_targets_its_own_vmms_with_their_memory_cgroup(tmp_path: Path) -> None:
    # Not `aenv-`: other nodes' sweeps on this machine must not take these for theirs.
    tag = f"damontest-{secrets.token_hex(3)}"
    home, other = tmp_path / "node", tmp_path / "other-node"
    home.mkdir()
    other.mkdir()
    mine = start_qemu(f"{tag}-mine", home, orphan=False)
    foreign = start_qemu(f"{tag}-foreign", other, orphan=False)
    try:
        _running({mine, foreign}, tag)
        # A child stays in its parent's cgroups (no driver moved this one).
        own = memcg_of(os.getpid())
        assert own is not None
        assert node_targets(home, prefix=tag) == [VmmTarget(mine, own)]
    finally:
        for pid in (mine, foreign):
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
