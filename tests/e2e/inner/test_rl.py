"""What RL harnesses use beyond E2B's API, with the unmodified SDK against real VMs: a sandbox
reset in place to its snapshot (`aenv.sdk.reset`), and a run's sandboxes and snapshots removed
by their metadata (`aenv rm --metadata`, `aenv.sdk.kill_by_metadata`)."""

from __future__ import annotations

from e2b import Sandbox

from aenv.sdk import kill_by_metadata, reset
from tests.e2e.inner.test_cli import aenv

SLEEPER = "'^sleep 10000[0]$'"


def test_reset_in_place_returns_to_the_snapshot_with_the_same_id_url_and_token() -> None:
    sandbox = Sandbox.create(timeout=300, metadata={"suite": "rl"})
    snapshot = None
    try:
        # A process started before the snapshot, holding a value only its memory has.
        sandbox.commands.run(
            "bash -c 'v=$RANDOM$RANDOM; echo $v > /tmp/value; exec sleep 100000'",
            background=True,
        )
        sandbox.commands.run("while [ ! -s /tmp/value ]; do sleep 0.05; done", timeout=120)
        value = sandbox.commands.run("cat /tmp/value").stdout
        snapshot = sandbox.create_snapshot()
        sandbox.files.write("/home/user/episode.txt", "written after the snapshot")
        # The pattern does not match the shell that runs pgrep or pkill itself.
        sandbox.commands.run(f"pkill -f {SLEEPER}", timeout=60)
        sandbox.commands.run(f"! pgrep -f {SLEEPER}", timeout=60)
        host = sandbox.get_host(49983)

        reset(sandbox, snapshot.snapshot_id)

        # The same SDK object, so the same id, URL and envd token, reaches the reset guest.
        assert sandbox.get_host(49983) == host
        assert not sandbox.files.exists("/home/user/episode.txt")
        assert sandbox.commands.run("cat /tmp/value").stdout == value
        assert sandbox.commands.run(f"pgrep -f {SLEEPER}").exit_code == 0
        info = sandbox.get_info()
        assert (info.sandbox_id, info.metadata) == (sandbox.sandbox_id, {"suite": "rl"})
        assert info.template_id == snapshot.snapshot_id
    finally:
        sandbox.kill()
        # Later suites (restart/test_after_crash_ops.py) count the node's snapshots.
        if snapshot is not None:
            assert Sandbox.delete_snapshot(snapshot.snapshot_id)


def test_rm_by_metadata_kills_a_runs_sandboxes_and_deletes_its_snapshots() -> None:
    run = [Sandbox.create(timeout=300, metadata={"run": "crashed", "rank": str(i)}) for i in (0, 1)]
    other = Sandbox.create(timeout=300, metadata={"run": "other"})
    try:
        snapshot = run[0].create_snapshot()
        deleted = aenv("rm", "--snapshot", "--metadata", "run=crashed")
        assert (deleted.returncode, deleted.stdout) == (0, f"{snapshot.snapshot_id}\n")
        killed = aenv("rm", "--metadata", "run=crashed")
        assert killed.returncode == 0, killed.stderr
        assert sorted(killed.stdout.split()) == sorted(s.sandbox_id for s in run)
        assert not any(s.is_running() for s in run) and other.is_running()
        assert kill_by_metadata({"run": "other"}) == {other.sandbox_id: None}
        assert not other.is_running()
    finally:
        for sandbox in (*run, other):
            sandbox.kill()
