"""kill -9 of the server while creates or deletes are in flight.

Two halves. The client (`python -m tests.e2e.restart.in_flight creates|deletes`, run inside the
server's namespace) starts several creates at once, or makes sandboxes and then deletes them all
at once. The outer side (`crash_during`, called by test_server.py from the root namespace) starts
that client and watches the server's catalog and processes: the moment VMs are being restored for
creates still in state `creating`, or a sandbox being deleted is in state `killing` or gone, it
SIGKILLs the server. The caller restarts it and runs test_nothing_stale.py.
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

from aenv.config import Paths
from tests.e2e.server_ns import REPO, ServerNs, in_netns
from tests.e2e.vmm_procs import vmm_pids

BASE = "http://127.0.0.1:3000"
SANDBOXES = 3
DELETES_FILE = "in-flight-deletes.json"


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


def _client(work: str) -> None:
    create = ("POST", "/v2/sandboxes", {"templateID": "base", "timeout": 600})
    if work == "creates":
        _concurrently([create] * SANDBOXES)
        return
    ids = []
    for _ in range(SANDBOXES):
        response = httpx.post(BASE + create[1], json=create[2], headers=_key(), timeout=120)
        response.raise_for_status()
        ids.append(response.json()["sandboxID"])
    Path(os.environ["AENV_HOME"], DELETES_FILE).write_text(json.dumps(ids))
    _concurrently([("DELETE", f"/sandboxes/{sandbox_id}", None) for sandbox_id in ids])


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


def _deletes_started(home: Path) -> bool:
    path = home / DELETES_FILE
    states = catalog_states(home)
    if not path.exists() or states is None:
        return False
    return any(states.get(i, "gone") in ("killing", "gone") for i in json.loads(path.read_text()))


def crash_during(server: ServerNs, work: str, timeout: float = 600) -> str:
    """Start `work` ("creates" or "deletes") and SIGKILL the server while it is under way.
    Returns what the catalog held at that moment (for the failure message of the next check)."""
    home = server.home
    (home / DELETES_FILE).unlink(missing_ok=True)
    ready = _creates_restoring if work == "creates" else _deletes_started
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
        client.wait(timeout=120)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    return at_crash


if __name__ == "__main__":
    _client(sys.argv[1])
