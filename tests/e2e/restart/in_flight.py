"""kill -9 of the server while creates, deletes, pauses, snapshots or a template build are in
flight, while the pause or snapshot of a resumed sandbox writes the pages it changed, or while
the background merge of a paused sandbox's memory layers writes the merged state.

Two halves. The client (`python -m tests.e2e.restart.in_flight WORK`, run inside the server's
namespace) starts several creates at once, makes sandboxes (and pauses and resumes them, for
repauses, resnapshots and merges) and then deletes, pauses or snapshots them all at once, or
builds a template whose RUN step takes minutes. The outer side (`crash_during`, called by
test_server.py from the root namespace) starts that client and watches the server's catalog,
processes and files: the moment VMs are being restored for creates still in state `creating`,
a sandbox being deleted is in state `killing` or gone, one is `pausing` or `snapshotting` (for
repauses and resnapshots: its new state file is being written), a merge has written part of
its state, or the build's VM runs, it SIGKILLs the server. The caller restarts it and runs
test_nothing_stale.py (and test_after_build_crash.py after a build).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from e2b import Sandbox

from aenv import atomic
from aenv.config import Paths
from aenv.orchestrator.detach import DETACHED, MERGE_DEPTH
from aenv.runtime.driver import RestoreError, Snapshot
from tests.e2e.server_ns import REPO, ServerNs, in_netns
from tests.e2e.vmm_procs import vmm_pids
from tests.support.http_wait import wait_until_up

BASE = "http://127.0.0.1:3000"
SANDBOXES = 3
IN_FLIGHT_FILE = "in-flight-ops.json"
BUILD_NAME = "cut-short"
MARKER = "/home/user/marker"
# What a sandbox cut in a merge holds besides the marker, for its resume to show: a process
# alive since before its pauses, and random bytes that only guest memory holds (tmpfs), with
# their checksum on its disk. The merge writes every page of the chain into one file: these
# MiB make it last long enough for the kill to land in it (~0.1 s alone on a busy machine,
# ~20 ms for an idle sandbox's few MiB) and keep the chain under half the guest's RAM
# (`ramlayers.chain`), still a layered one.
PROCESS_PID = "/home/user/process.pid"
FILL = "/dev/shm/fill"
FILL_SUM = "/home/user/fill.sha256"
FILL_MIB = 16


# -- the client, inside the namespace -----------------------------------------------------


def _key() -> dict[str, str]:
    return {"X-API-KEY": Paths(Path(os.environ["AENV_HOME"])).api_key.read_text().strip()}


def _concurrently(calls: list[tuple[str, str, dict[str, object] | None]]) -> None:
    """Send the requests at once; the server dies under them, so errors are expected."""

    def send(method: str, path: str, body: dict[str, object] | None) -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.request(method, BASE + path, json=body, headers=_key(), timeout=300)

    threads = [threading.Thread(target=send, args=call) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _record_in_flight(work: str, ids: list[str]) -> None:
    # Replaced whole: the outer side reads it over and over while it waits (`in_flight_ids`).
    atomic.write_text(Path(os.environ["AENV_HOME"], IN_FLIGHT_FILE), json.dumps({work: ids}))


def _prepare(sandbox_id: str, work: str) -> None:
    """What a cut-short pause, snapshot or merge must keep (test_nothing_stale.py reads it)."""
    os.environ.update(E2B_API_KEY=_key()["X-API-KEY"], E2B_API_URL=BASE, E2B_SANDBOX_URL=BASE)
    os.environ.pop("E2B_DEBUG", None)
    sandbox = Sandbox.connect(sandbox_id)
    sandbox.files.write(MARKER, sandbox_id)
    if work == "merges":
        fill = f"head -c {FILL_MIB}M /dev/urandom > {FILL} && sha256sum {FILL} > {FILL_SUM}"
        sandbox.commands.run(fill, timeout=300)
        pid = sandbox.commands.run("sleep 86400", background=True, timeout=0).pid
        sandbox.files.write(PROCESS_PID, str(pid))


def _dirty(sandbox_id: str) -> None:
    """Pages changed since the resume, which the repause or resnapshot streams: enough that
    its state file is written for longer than the outer side's look (an idle sandbox's few
    changed MiB streamed between two looks on a quiet host, and the kill never came)."""
    sandbox = Sandbox.connect(sandbox_id)
    sandbox.commands.run(f"head -c {FILL_MIB}M /dev/urandom > /dev/shm/dirty", timeout=300)


def _outlive_the_server(seconds: float = 120) -> None:
    """Wait until the server is killed: a merge starts after the pause has answered."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{BASE}/health", timeout=5)
        except httpx.HTTPError:
            return
        time.sleep(0.2)


def _build() -> None:
    """Build template BUILD_NAME with a RUN step that outlasts the server; the build's end is
    never seen (the server dies under it)."""
    from e2b import Template

    assert wait_until_up(f"{BASE}/health", 1200), "the server did not come up"
    os.environ.update(E2B_API_KEY=_key()["X-API-KEY"], E2B_API_URL=BASE)
    os.environ.pop("E2B_DEBUG", None)
    template = Template().from_template("base").run_cmd("sleep 600")
    _record_in_flight("builds", [BUILD_NAME])
    with contextlib.suppress(Exception):
        Template.build(template, alias=BUILD_NAME)


def _client(work: str) -> None:
    create = ("POST", "/v2/sandboxes", {"templateID": "base", "timeout": 600})
    if work == "builds":
        _build()
        return
    if work == "creates":
        _concurrently([create] * SANDBOXES)
        return
    ids = []
    for _ in range(SANDBOXES):
        response = httpx.post(BASE + create[1], json=create[2], headers=_key(), timeout=120)
        response.raise_for_status()
        ids.append(response.json()["sandboxID"])
        _prepare(ids[-1], work)
        for _ in range(_CYCLES.get(work, 0)):
            for step, body in (("pause", None), ("resume", {"timeout": 600})):
                url = f"{BASE}/sandboxes/{ids[-1]}/{step}"
                httpx.post(url, json=body, headers=_key(), timeout=300).raise_for_status()
        if work in _RESUMED_FIRST:
            _dirty(ids[-1])
    _record_in_flight(work, ids)
    method, path = _REQUESTS[work]
    _concurrently([(method, path.format(id=sandbox_id), None) for sandbox_id in ids])
    if work == "merges":
        _outlive_the_server()


_REQUESTS = {
    "deletes": ("DELETE", "/sandboxes/{id}"),
    "merges": ("POST", "/sandboxes/{id}/pause"),
    "pauses": ("POST", "/sandboxes/{id}/pause"),
    "repauses": ("POST", "/sandboxes/{id}/pause"),
    "resnapshots": ("POST", "/sandboxes/{id}/snapshots"),
    "snapshots": ("POST", "/sandboxes/{id}/snapshots"),
}
# The catalog state a sandbox is in while each kind of work on it is under way.
_UNDER_WAY = {
    "deletes": ("killing", "gone"),
    "pauses": ("pausing",),
    "repauses": ("pausing",),
    "snapshots": ("snapshotting",),
    "resnapshots": ("snapshotting",),
}
# Works on sandboxes paused and resumed first, cut while their save streams its state.
_RESUMED_FIRST = ("repauses", "resnapshots")
# Pause/resume cycles before the work: its save then lies over that many older states (each
# save's layer). For merges, as many as make the last pause's chain deep enough to be merged.
_CYCLES = {"repauses": 1, "resnapshots": 1, "merges": MERGE_DEPTH}


# -- the outer side -----------------------------------------------------------------------


def catalog_states(home: Path) -> dict[str, str] | None:
    """Sandbox states in the catalog; None when it cannot be read right now."""
    try:
        db = sqlite3.connect(f"file:{Paths(home).catalog}?mode=ro", uri=True, timeout=1)
        try:
            return dict(db.execute("SELECT id, state FROM sandboxes").fetchall())
        finally:
            db.close()
    except sqlite3.OperationalError:
        return None


def _creates_restoring(home: Path) -> bool:
    states = catalog_states(home) or {}
    return any(vmm_pids(i) for i, state in states.items() if state == "creating")


def in_flight_ids(home: Path) -> dict[str, list[str]]:
    """{work: the ids of the sandboxes it was started on} for the last crash, if any."""
    path = home / IN_FLIGHT_FILE
    ids: dict[str, list[str]] = json.loads(path.read_text()) if path.exists() else {}
    return ids


def _build_vm_runs(home: Path) -> bool:
    """A build's VM is up (and about to run, or running, its long RUN step)."""
    try:
        db = sqlite3.connect(f"file:{Paths(home).catalog}?mode=ro", uri=True, timeout=1)
        try:
            rows = db.execute("SELECT id FROM sandboxes WHERE internal AND state = 'running'")
            ids = [i for (i,) in rows.fetchall()]
        finally:
            db.close()
    except sqlite3.OperationalError:
        return False
    return any(vmm_pids(i) for i in ids)


def _ops_started(home: Path) -> bool:
    states = catalog_states(home)
    if states is None:
        return False
    return any(
        states.get(i, "gone") in _UNDER_WAY[work]
        for work, ids in in_flight_ids(home).items()
        for i in ids
    )


def _saves_streaming(home: Path) -> bool:
    """A repause or resnapshot is writing its state: a new pause checkpoint's or snapshot
    build's `state` file has the first of the changed pages QEMU streams through the filter,
    and no manifest yet."""
    ids = in_flight_ids(home)
    states = catalog_states(home) or {}
    state_files = [
        state
        for work in _RESUMED_FIRST
        for sandbox_id in ids.get(work, [])
        if states.get(sandbox_id) in _UNDER_WAY[work]
        for state in (
            (Paths(home).sandboxes / sandbox_id).glob("pause-*/state")
            if work == "repauses"
            else Paths(home).templates.glob("*/*/state")  # a snapshot's build directory
        )
    ]
    for state in state_files:
        with contextlib.suppress(FileNotFoundError):
            if state.stat().st_size > 0 and not (state.parent / "snapshot.json").exists():
                return True
    return False


def _merges_writing(home: Path) -> dict[Path, int]:
    """{merged state: its size} of the merges under way for the merges' sandboxes: a pause
    checkpoint's `detached/state` with bytes in it that its manifest does not name yet."""
    writing = {}
    for sandbox_id in in_flight_ids(home).get("merges", []):
        for state in (Paths(home).sandboxes / sandbox_id).glob(f"pause-*/{DETACHED}/state"):
            try:
                size = state.stat().st_size
                adopted = Snapshot.load_manifest(state.parent.parent).state_file == state
            except (FileNotFoundError, RestoreError):
                continue  # pruned meanwhile
            if size > 0 and not adopted:
                writing[state] = size
    return writing


def _merge_written(home: Path) -> bool:
    """Every pause of the merges' sandboxes has ended (so none is cut mid-save, as repauses
    are) and a merge is writing."""
    if not _merges_writing(home):
        return False
    states = catalog_states(home) or {}
    return all(states.get(i) == "paused" for i in in_flight_ids(home)["merges"])


def crash_during(server: ServerNs, work: str, timeout: float = 600) -> str:
    """Start `work` ("creates", "deletes", "pauses", "repauses", "snapshots", "resnapshots",
    "merges" or "builds") and SIGKILL the server while it is under way: a repause or
    resnapshot (the save of a sandbox paused and resumed before, which writes only the pages
    it changed since) while its state streams in; merges (the background merge of the memory
    layers of sandboxes paused over a chain MERGE_DEPTH deep) while a merged state is being
    written, which is checked again once the server is dead.
    Returns what the catalog held at that moment (for the failure message of the next check)."""
    home = server.home
    (home / IN_FLIGHT_FILE).unlink(missing_ok=True)
    ready = {
        "creates": _creates_restoring,
        "builds": _build_vm_runs,
        "repauses": _saves_streaming,
        "resnapshots": _saves_streaming,
        "merges": _merge_written,
    }.get(work, _ops_started)
    client = subprocess.Popen(
        in_netns(server.netns, sys.executable, "-m", "tests.e2e.restart.in_flight", work),
        cwd=REPO, env=server.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while not ready(home):
            if client.poll() is not None or time.monotonic() > deadline:
                out = client.stdout.read().decode(errors="replace") if client.stdout else ""
                raise AssertionError(f"{work} never got under way:\n{out[-5000:]}")
            time.sleep(0.005)
        server.kill_9()
        at_crash = f"{work} in flight at the kill: {catalog_states(home)}"
        if work == "merges":
            # Seen mid-write a moment before the kill, so a miss needs a merge to end within
            # that moment: the fill makes one last far longer.
            cut = _merges_writing(home)
            assert cut, f"every merge ended before the kill landed; {at_crash}"
            at_crash += f"; merged states cut short (bytes written): {cut}"
        if work == "builds":
            client.kill()  # it has nothing to say: the build's end is never answered
        client.wait(timeout=120)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    return at_crash


if __name__ == "__main__":
    _client(sys.argv[1])
