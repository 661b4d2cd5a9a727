import json
import os
from pathlib import Path

import pytest
from e2b import Sandbox, SandboxException

from aenv.config import Paths
from tests.e2e.vmm_procs import vmm_pids


def test_restart_reports_nothing_it_cannot_serve() -> None:
    home = Path(os.environ["AENV_HOME"])
    old = json.loads((home / "crash-ids.json").read_text())
    listed = [s.sandbox_id for s in Sandbox.list().next_items()]
    assert not set(old) & set(listed)
    for sandbox_id in old:
        with pytest.raises(SandboxException):
            Sandbox.connect(sandbox_id)
    assert not any((Paths(home).sandboxes / sandbox_id).exists() for sandbox_id in old)
    for sandbox_id in old:
        assert vmm_pids(sandbox_id) == [], f"an orphaned VMM of {sandbox_id} survived"
    fresh = Sandbox.create(timeout=60)
    try:
        assert fresh.commands.run("echo ok").stdout == "ok\n"
    finally:
        fresh.kill()
