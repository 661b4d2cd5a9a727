"""Pause, resume, auto-pause and auto-resume with the unmodified SDK against real VMs."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, SandboxQuery, SandboxState

from aenv.config import Paths
from aenv.orchestrator import checkpoints
from aenv.orchestrator.detach import DETACHED, MERGE_DEPTH
from tests.e2e.inner.conftest import BASE

# A counter that lives only in a shell's memory; the file shows its latest value (replaced
# atomically, so a read never sees it half-written).
COUNTER = (
    "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter.new; "
    "mv /tmp/counter.new /tmp/counter; sleep 0.1; done"
)


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    sbx = Sandbox.create(timeout=300)
    try:
        yield sbx
    finally:
        sbx.kill()


def _start_counter(sbx: Sandbox) -> int:
    pid: int = sbx.commands.run(COUNTER, background=True).pid
    sbx.commands.run("while [ ! -s /tmp/counter ]; do sleep 0.05; done", timeout=120)
    return pid


def _counter(sbx: Sandbox) -> int:
    return int(sbx.files.read("/tmp/counter").strip() or 0)


def _state(sandbox_id: str) -> str:
    return Sandbox.get_info(sandbox_id).state.value


def test_pause_and_connect_keep_files_and_processes(sandbox: Sandbox) -> None:
    sandbox.files.write("/home/user/kept.txt", "before pause")
    counter = _start_counter(sandbox)
    before = _counter(sandbox)

    assert sandbox.pause() is True
    assert _state(sandbox.sandbox_id) == "paused"
    paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
    assert sandbox.sandbox_id in {s.sandbox_id for s in paused}
    assert sandbox.pause() is False  # already paused: the SDK's 409 case

    resumed = Sandbox.connect(sandbox.sandbox_id, timeout=120)
    assert _state(sandbox.sandbox_id) == "running"
    assert resumed.files.read("/home/user/kept.txt") == "before pause"
    time.sleep(0.5)
    assert _counter(resumed) > before  # same process, counting on from its memory
    pids = {p.pid for p in resumed.commands.list()}
    assert counter in pids


def _detached_checkpoint(sandbox_id: str) -> Path:
    """Wait until the sandbox's newest checkpoint has its memory detached into a file (done in
    the background after a pause returns) and return that checkpoint's directory."""
    sandbox_dir = Paths(Path(os.environ["AENV_HOME"])).sandboxes / sandbox_id
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pauses = sorted(sandbox_dir.glob("pause-*"), key=lambda d: int(d.name.split("-")[1]))
        if pauses and (pauses[-1] / "snapshot.json").is_file():
            manifest = json.loads((pauses[-1] / "snapshot.json").read_text())
            if manifest["memory_file"]:
                return pauses[-1]
        time.sleep(0.1)
    pytest.fail(f"the checkpoint of {sandbox_id} never got a memory file")


def test_resume_from_detached_memory_keeps_files_and_processes(sandbox: Sandbox) -> None:
    sandbox.files.write("/home/user/kept.txt", "detached")
    counter = _start_counter(sandbox)
    time.sleep(0.3)
    before = _counter(sandbox)
    assert sandbox.pause() is True
    checkpoint = _detached_checkpoint(sandbox.sandbox_id)
    # A restored sandbox's pause keeps only the pages it changed; its memory file is then the
    # base it was restored from (runtime/ramdelta.py), else a file detached into the checkpoint.
    manifest = json.loads((checkpoint / "snapshot.json").read_text())
    assert (checkpoint / manifest["memory_file"]).is_file()
    resumed = Sandbox.connect(sandbox.sandbox_id, timeout=120)
    assert resumed.files.read("/home/user/kept.txt") == "detached"
    time.sleep(0.5)
    assert _counter(resumed) > before
    assert counter in {p.pid for p in resumed.commands.list()}
    # And once more from the resumed VM, whose memory is a private mapping of that file.
    assert resumed.pause() is True
    _detached_checkpoint(sandbox.sandbox_id)
    again = Sandbox.connect(sandbox.sandbox_id, timeout=120)
    assert again.files.read("/home/user/kept.txt") == "detached"
    assert counter in {p.pid for p in again.commands.list()}


def _pause_layers(sandbox_id: str) -> tuple[int, bool]:
    """How many memory layers the sandbox's newest pause lies over, and whether it is a delta
    against the base (no layers, and not the merged form of a chain)."""
    sandbox_dir = Paths(Path(os.environ["AENV_HOME"])).sandboxes / sandbox_id
    found = checkpoints.latest_pause(sandbox_dir)
    assert found is not None
    saved = found[1]
    return len(saved.layers), not saved.layers and saved.state_file.parent.name != DETACHED


def test_ten_pause_resume_cycles_lose_nothing(sandbox: Sandbox) -> None:
    _start_counter(sandbox)
    last = 0
    sbx = sandbox
    for cycle in range(10):
        sbx.files.write(f"/home/user/cycle-{cycle}.txt", f"written in cycle {cycle}")
        time.sleep(0.3)
        value = _counter(sbx)
        assert value > last, f"cycle {cycle}: counter went from {last} to {value}"
        last = value
        assert sbx.pause() is True
        # Resumed at once, the chain is merged by the resumes (never by the background merge,
        # which the connect stops): no pause lies over more, none past the first saves all
        # it changed since the base again.
        depth, against_base = _pause_layers(sandbox.sandbox_id)
        assert depth <= MERGE_DEPTH, f"cycle {cycle}: a pause over {depth} layers"
        assert cycle < 2 or not against_base, f"cycle {cycle}: a delta against the base"
        sbx = Sandbox.connect(sandbox.sandbox_id, timeout=120)
    for cycle in range(10):
        assert sbx.files.read(f"/home/user/cycle-{cycle}.txt") == f"written in cycle {cycle}"
    time.sleep(0.3)
    assert _counter(sbx) > last


def test_timeout_with_auto_pause_pauses_then_connect_resumes() -> None:
    sbx = Sandbox.create(timeout=3, lifecycle={"on_timeout": "pause"})
    try:
        sbx.files.write("/tmp/state.txt", "survives the timeout")
        deadline = time.monotonic() + 60
        while _state(sbx.sandbox_id) != "paused":
            assert time.monotonic() < deadline, "auto-pause did not happen"
            time.sleep(0.5)
        info = Sandbox.get_info(sbx.sandbox_id)
        assert info.lifecycle is not None and info.lifecycle["on_timeout"] == "pause"
        resumed = Sandbox.connect(sbx.sandbox_id, timeout=60)
        assert resumed.files.read("/tmp/state.txt") == "survives the timeout"
    finally:
        sbx.kill()


def test_traffic_to_auto_resume_sandbox_resumes_it() -> None:
    sbx = Sandbox.create(timeout=120, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sbx.files.write("/tmp/x", "auto")
        assert sbx.pause() is True
        # The old handle's envd traffic goes through the proxy, which resumes the sandbox.
        assert sbx.commands.run("cat /tmp/x").stdout == "auto"
        assert _state(sbx.sandbox_id) == "running"
    finally:
        sbx.kill()


def test_traffic_to_paused_sandbox_without_auto_resume_is_refused(sandbox: Sandbox) -> None:
    assert sandbox.pause() is True
    response = httpx.get(
        f"{BASE}/health",
        headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49983"},
    )
    assert response.status_code == 502  # infra's status for a sandbox not running
    assert "paused" in response.json()["message"]
    assert _state(sandbox.sandbox_id) == "paused"


def test_pause_resume_kill_race_converges(sandbox: Sandbox) -> None:
    import concurrent.futures

    sandbox_id = sandbox.sandbox_id
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(Sandbox.pause, sandbox_id) for _ in range(3)]
        # `Sandbox.connect` is overloaded for the class and an instance; mypy picks neither.
        futures += [pool.submit(Sandbox.connect, sandbox_id, 60) for _ in range(3)]  # type: ignore[arg-type]
        for f in futures:
            f.exception()  # any outcome is fine; the end state must be consistent
    state = _state(sandbox_id)
    assert state in ("running", "paused")
    if state == "paused":
        Sandbox.connect(sandbox_id, timeout=60)
    assert Sandbox.connect(sandbox_id, timeout=60).commands.run("echo ok").stdout == "ok\n"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: Sandbox.kill(sandbox_id), range(4)))
    assert results.count(True) == 1
    with pytest.raises(Exception, match="not found"):
        Sandbox.get_info(sandbox_id)


def test_filesystem_auto_pause_and_strict_pause() -> None:
    sbx = Sandbox.create(
        timeout=120, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}}
    )
    try:
        sbx.files.write("/home/user/disk.txt", "on disk")
        _start_counter(sbx)
        detail = httpx.get(
            f"{BASE}/sandboxes/{sbx.sandbox_id}",
            headers={"X-API-Key": os.environ["E2B_API_KEY"]},
        ).json()
        assert detail["pauseMode"] == "filesystem"
        assert sbx.pause(strict=True) is True  # envd answers, so a strict pause goes ahead
        sbx = Sandbox.connect(sbx.sandbox_id, timeout=120)
        # The strict pause above kept memory; now let the timeout pause filesystem-only.
        sbx.set_timeout(2)
        deadline = time.monotonic() + 60
        while _state(sbx.sandbox_id) != "paused":
            assert time.monotonic() < deadline, "auto-pause did not happen"
            time.sleep(0.5)
        # Filesystem-only: the checkpoint holds the disk layer and no memory at all.
        sandbox_dir = Paths(Path(os.environ["AENV_HOME"])).sandboxes / sbx.sandbox_id
        newest = max(sandbox_dir.glob("pause-*"), key=lambda d: int(d.name.split("-")[1]))
        manifest = json.loads((newest / "snapshot.json").read_text())
        assert manifest["machine_state"] is False and manifest["memory_file"] is None
        assert (newest / "state").stat().st_size == 0
        rebooted = Sandbox.connect(sbx.sandbox_id, timeout=120)  # cold boot from the disks
        assert rebooted.files.read("/home/user/disk.txt") == "on disk"
        assert "/tmp/counter" not in rebooted.commands.run("ps -eo args").stdout
    finally:
        sbx.kill()
