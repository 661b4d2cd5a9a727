from __future__ import annotations

import os
import signal
import time

import pytest
from e2b import Sandbox, SandboxException

from tests.e2e.vmm_procs import vmm_pids


def test_kill_9_of_one_vmm_removes_only_that_sandbox() -> None:
    victim = Sandbox.create(timeout=120)
    bystander = Sandbox.create(timeout=120)
    try:
        bystander.files.write("/tmp/state", "kept")
        pids = vmm_pids(victim.sandbox_id)
        assert pids, "the victim's VMM process was not found"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while victim.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]:
            if time.monotonic() > deadline:
                pytest.fail("a sandbox whose VMM died is still listed")
            time.sleep(0.2)
        with pytest.raises(SandboxException):
            victim.get_info()
        assert not victim.is_running()
        assert bystander.files.read("/tmp/state") == "kept"
        assert bystander.commands.run("echo alive").stdout == "alive\n"
    finally:
        bystander.kill()
        victim.kill()
