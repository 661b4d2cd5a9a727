"""After the crash: every sandbox the server reports is really there (paused ones resume with
their files, running ones answer), work cut short left nothing half-made, and nothing else
survived."""

import json
import os
from pathlib import Path

from e2b import Sandbox

from aenv.config import Paths
from tests.e2e.vmm_procs import vmm_pids


def test_only_paused_sandboxes_survive_a_crash() -> None:
    # No VM outlives the server, so whatever is listed now must be paused (fork children that
    # were starting and sandboxes mid-snapshot were running: they are gone, VMMs and all).
    home = Path(os.environ["AENV_HOME"])
    listed = {s.sandbox_id: s.state.value for s in Sandbox.list().next_items()}
    assert set(listed.values()) <= {"paused"}, listed
    for sandbox_dir in Paths(home).sandboxes.iterdir():
        assert sandbox_dir.name in listed, f"files of {sandbox_dir.name} were left behind"


def test_paused_sandbox_survives_the_crash() -> None:
    home = Path(os.environ["AENV_HOME"])
    parked = json.loads((home / "crash-ops.json").read_text())["parked"]
    assert Sandbox.get_info(parked).state.value == "paused"
    resumed = Sandbox.connect(parked, timeout=60)
    try:
        assert resumed.files.read("/home/user/parked.txt") == "paused before the crash"
    finally:
        resumed.kill()


def test_cut_operations_left_a_consistent_state() -> None:
    home = Path(os.environ["AENV_HOME"])
    busy = json.loads((home / "crash-ops.json").read_text())["busy"]
    listed = {s.sandbox_id: s.state.value for s in Sandbox.list().next_items()}
    for sandbox_id in busy:
        state = listed.get(sandbox_id)
        # Running sandboxes die with the server; the pause may have completed first.
        assert state in (None, "paused"), f"{sandbox_id} reported {state}"
        if state == "paused":
            sbx = Sandbox.connect(sandbox_id, timeout=60)
            assert sbx.files.read("/home/user/busy.txt") == sandbox_id
            sbx.kill()
        else:
            assert not (Paths(home).sandboxes / sandbox_id).exists()
            assert vmm_pids(sandbox_id) == []
    # A snapshot either completed (and works) or left nothing behind.
    for snap in Sandbox.list_snapshots().next_items():
        child = Sandbox.create(snap.snapshot_id, timeout=60)
        assert child.files.read("/home/user/busy.txt") == busy[1]
        child.kill()
        assert Sandbox.delete_snapshot(snap.snapshot_id)
    for template_dir in Paths(home).templates.iterdir():
        assert (template_dir / "template.json").exists(), f"half-made {template_dir.name}"
