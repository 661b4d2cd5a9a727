"""Every VMM of the running node is jailed (issue 14): for each process whose command line is one
of this node's QEMUs, /proc/<pid>/status shows a uid other than 0, no capabilities, no_new_privs
and seccomp filtering, and its root shows no host file outside the node's data dir, its tmpfs
memory tree and /usr (its guest images are in the data dir's cache)."""

from __future__ import annotations

import os
from pathlib import Path

from e2b import Sandbox

from aenv.config import Paths
from tests.e2e.vmm_procs import node_vmm_pids
from tests.support.jail import jail_problems


def test_every_vmm_of_the_node_is_jailed() -> None:
    home = Path(os.environ["AENV_HOME"])
    sandboxes = [Sandbox.create(timeout=120) for _ in range(2)]
    try:
        assert [s.commands.run("id -u").stdout.strip() for s in sandboxes] == ["1000"] * 2
        sandboxes[1].pause()  # a paused sandbox has no VMM; its resume gets a new one
        Sandbox.connect(sandboxes[1].sandbox_id, timeout=120)
        pids = node_vmm_pids(home)
        assert len(pids) >= 2
        allowed = [home, Paths(home).memory]
        assert {pid: jail_problems(pid, allowed) for pid in pids} == {pid: [] for pid in pids}
        uids = {Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[0] for pid in pids}
        assert len(uids) == len(pids)  # one uid per VMM
    finally:
        for s in sandboxes:
            s.kill()
