"""kill -9 of the server while creates, deletes, pauses, snapshots or a template build are in
flight, or while the pause or snapshot of a resumed sandbox writes the pages it changed.

Two halves. The client (`python -m tests.e2e.restart.in_flight WORK`, run inside the server's
namespace) starts several creates at once, makes sandboxes (and pauses and resumes them, for
repauses and resnapshots) and then deletes, pauses or snapshots them all at once, or builds a
template whose RUN step takes minutes. The outer side (`crash_during`, called by test_server.py
from the root namespace) starts that client and watches the server's catalog and processes:
the moment VMs are being restored for creates still in state `creating`, a sandbox being
deleted is in state `killing` or gone, one is `pausing` or `snapshotting` (for repauses and
resnapshots: its new state file is being written), or the build's VM runs, it SIGKILLs the
server. The caller restarts it and runs test_nothing_stale.py (and test_after_build_crash.py
after a build).
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
from tests.e2e.server_ns import REPO, ServerNs, in_netns
from tests.e2e.vmm_procs import vmm_pids
from tests.support.http_wait import wait_until_up

BASE = "http://127.0.0.1:3000"
SANDBOXES = 3
IN_FLIGHT_FILE = "in-flight-ops.json"
BUILD_NAME = "cut-short"
MARKER = "/home/user/marker"


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


def _write_marker(sandbox_id: str) -> None:
    os.environ.update(E2B_API_KEY=_key()["X-API-KEY"], E2B_API_URL=BASE, E2B_SANDBOX_URL=BASE)
    os.environ.pop("E2B_DEBUG", None)
    Sandbox.connect(sandbox_id).files.write(MARKER, sandbox_id)


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
        # What a cut-short pause or snapshot must keep (test_nothing_stale.py reads it back).
        _write_marker(ids[-1])
        if work in _RESUMED_FIRST:  # resumed once: its next save writes what changed since
            for step, body in (("pause", None), ("resume", {"timeout": 600})):
                url = f"{BASE}/sandboxes/{ids[-1]}/{step}"
                httpx.post(url, json=body, headers=_key(), timeout=300).raise_for_status()
    _record_in_flight(work, ids)
    method, path = _REQUESTS[work]
    _concurrently([(method, path.format(id=sandbox_id), None) for sandbox_id in ids])


_REQUESTS = {
    "deletes": ("DELETE", "/sandboxes/{id}"),
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


def crash_during(server: ServerNs, work: str, timeout: float = 600) -> str:
    """Start `work` ("creates", "deletes", "pauses", "repauses", "snapshots", "resnapshots" or
    "builds") and SIGKILL the server while it is under way: a repause or resnapshot (the save
    of a sandbox paused and resumed before, which writes only the pages it changed since) while
    its state streams in.
    Returns what the catalog held at that moment (for the failure message of the next check)."""
    home = server.home
    (home / IN_FLIGHT_FILE).unlink(missing_ok=True)
    ready = {
        "creates": _creates_restoring,
        "builds": _build_vm_runs,
        "repauses": _saves_streaming,
        "resnapshots": _saves_streaming,
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
