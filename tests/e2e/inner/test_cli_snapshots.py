"""`aenv pause`, `resume`, `snapshot`, `snapshots`, `fork` and `rm --snapshot` against the real
server: one sandbox paused, resumed, saved and forked, then forks from its snapshot."""

from __future__ import annotations

import json

from e2b import Sandbox

from tests.e2e.inner.test_cli import aenv


def _state(sandbox_id: str) -> str:
    listed = json.loads(aenv("ls", "--json").stdout)
    return next(str(s["state"]) for s in listed if s["sandboxID"] == sandbox_id)


def _children(fork: list[str]) -> list[str]:
    ran = aenv("fork", *fork)
    assert ran.returncode == 0 and ran.stderr == "", ran.stderr
    return ran.stdout.split()


def test_pause_resume_snapshot_fork_and_rm_snapshot() -> None:
    sandbox = Sandbox.create(timeout=300)
    sid = sandbox.sandbox_id
    created = [sid]
    try:
        sandbox.files.write("/home/user/state.txt", "before the snapshot")
        paused = aenv("pause", sid)
        assert (paused.returncode, paused.stdout) == (0, f"{sid}\n"), paused.stderr
        assert _state(sid) == "paused"
        again = aenv("pause", sid)
        assert again.returncode == 1
        assert again.stderr.strip() == f"409: cannot pause sandbox {sid}: it is paused"
        assert aenv("resume", sid, "--timeout", "300").stdout == f"{sid} resumed\n"
        as_json = json.loads(aenv("resume", sid, "--json").stdout)
        assert as_json["sandboxID"] == sid and as_json["resumed"] is False
        assert "envdAccessToken" not in as_json and "trafficAccessToken" not in as_json

        saved = aenv("snapshot", sid, "--name", "cli-snap")
        assert saved.returncode == 0, saved.stderr
        snapshot_id, names = saved.stdout.split()
        assert names == "cli-snap"
        assert snapshot_id in aenv("snapshots").stdout
        mine = json.loads(aenv("snapshots", "--sandbox", sid, "--json").stdout)
        assert mine == [{"snapshotID": snapshot_id, "names": ["cli-snap"]}]
        named = json.loads(aenv("snapshots", "--name", "cli-snap", "--json").stdout)
        assert [s["snapshotID"] for s in named] == [snapshot_id]

        # Forks of the sandbox and of its snapshot (no live parent) all have its file.
        forks = _children([sid, "--count", "2", "--timeout", "120"])
        created += forks
        from_snapshot = _children(["cli-snap"])
        created += from_snapshot
        assert len(set(forks + from_snapshot) | {sid}) == 4
        for child in forks + from_snapshot:
            assert _state(child) == "running"
            connected = Sandbox.connect(child)
            assert connected.files.read("/home/user/state.txt") == "before the snapshot"

        removed = aenv("rm", "--snapshot", "cli-snap")
        assert (removed.returncode, removed.stdout) == (0, "cli-snap\n"), removed.stderr
        assert json.loads(aenv("snapshots", "--json", "--sandbox", sid).stdout) == []
        gone = aenv("rm", "--snapshot", "cli-snap")
        assert (gone.returncode, gone.stderr.strip()) == (1, "error: snapshot 'cli-snap' not found")
        # A template is not a snapshot: `rm --snapshot` leaves it alone.
        assert aenv("rm", "--snapshot", "base").returncode == 1
        failed = aenv("fork", "cli-snap")
        assert failed.returncode == 1 and "404" in failed.stderr
    finally:
        assert aenv("rm", *created).returncode == 0
