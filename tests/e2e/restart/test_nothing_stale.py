"""After a kill -9 of the server and a restart (see in_flight.py): the node reports only what
really runs (or is paused), and nothing of anything else is left: no VMM process, sandbox or
memory directory, catalog row in a passing state, network slot beyond the warm pool, or state
of a detach or merge that no checkpoint uses. A sandbox cut in a pause or snapshot is whole or
gone; one whose memory layers were being merged resumes whole, and pauses and resumes again;
every listed snapshot starts, and new creates work."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import time
from contextlib import closing
from pathlib import Path

import httpx
import pytest
from e2b import NotFoundException, Sandbox

from aenv.config import Paths
from aenv.orchestrator.detach import DETACHED
from aenv.runtime.driver import RestoreError, Snapshot
from tests.e2e.inner.conftest import BASE
from tests.e2e.restart.in_flight import FILL_SUM, MARKER, PROCESS_PID, in_flight_ids
from tests.e2e.vmm_procs import strays, vmm_pids

HOME = Path(os.environ["AENV_HOME"])


def _slot_namespaces() -> list[str]:
    prefix = os.environ["AENV_NETWORK_PREFIX"]
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [n for n in (line.split()[0] for line in out.splitlines() if line) if
            re.fullmatch(rf"{re.escape(prefix)}-\d+", n)]  # fmt: skip


def _catalog_states() -> set[str]:
    with closing(sqlite3.connect(f"file:{Paths(HOME).catalog}?mode=ro", uri=True)) as db:
        return {state for (state,) in db.execute("SELECT state FROM sandboxes")}


def _unused_forms() -> list[Path]:
    """Detached or merged forms (`pause-*/detached/`) whose checkpoint's manifest names
    another state: what a detach or merge cut short wrote."""
    unused = []
    for form in Paths(HOME).sandboxes.glob(f"*/pause-*/{DETACHED}"):
        try:
            in_use = Snapshot.load_manifest(form.parent).state_file.parent == form
        except RestoreError:
            in_use = False
        if not in_use:
            unused.append(form)
    return unused


def test_only_what_really_runs_is_reported_and_nothing_else_is_left() -> None:
    listed = {s.sandbox_id: s.state.value for s in Sandbox.list().next_items()}
    running = {i for i, state in listed.items() if state == "running"}
    for sandbox_id in running:
        assert vmm_pids(sandbox_id), f"{sandbox_id} is listed as running without a VMM"
    stray = {i: lines for i, lines in strays(HOME).items() if i not in running}
    assert not stray, f"processes of the killed server survived the restart: {stray}"
    assert _catalog_states() <= {"running", "paused"}, "rows of cut-short work remain"
    for directory in (Paths(HOME).sandboxes, Paths(HOME).memory / "sandboxes"):
        left = {p.name for p in directory.iterdir()} if directory.exists() else set()
        assert left <= set(listed), f"leftovers in {directory}: {left - set(listed)}"
    # Slots are held by running sandboxes and the warm pool, nothing else.
    warm = int(os.environ["AENV_WARM_SLOTS_HIGH"])
    assert len(_slot_namespaces()) <= len(running) + warm
    # Deletes in flight at the crash: none of them came back.
    assert not set(in_flight_ids(HOME).get("deletes", [])) & set(listed)
    assert not _unused_forms(), "a cut-short detach or merge left its state"


def test_sandboxes_cut_in_a_pause_or_snapshot_are_whole_or_gone() -> None:
    """A sandbox whose pause or snapshot the crash cut short is either still there and works
    (a paused one resumes with its files) or cleanly reported gone; never half of either."""
    listed = {s.sandbox_id: s.state.value for s in Sandbox.list().next_items()}
    for work in ("pauses", "repauses", "snapshots", "resnapshots"):
        for sandbox_id in in_flight_ids(HOME).get(work, []):
            if sandbox_id not in listed:
                with pytest.raises(NotFoundException):
                    Sandbox.get_info(sandbox_id)
                continue
            sandbox = Sandbox.connect(sandbox_id, timeout=120)  # resumes a paused one
            try:
                assert sandbox.files.read(MARKER) == sandbox_id
            finally:
                sandbox.kill()


def _uploaded(sandbox_id: str) -> bool:
    """The repository holds the sandbox's newest checkpoint."""
    with closing(sqlite3.connect(f"file:{Paths(HOME).catalog}?mode=ro", uri=True)) as db:
        row = db.execute(
            "SELECT archive_seq = checkpoint_seq FROM sandboxes WHERE id = ?", (sandbox_id,)
        ).fetchone()
    return bool(row and row[0])


def _assert_whole(sandbox: Sandbox) -> None:
    """The marker on its disk, the process it ran, and the bytes only its memory held."""
    assert sandbox.files.read(MARKER) == sandbox.sandbox_id
    pid = int(sandbox.files.read(PROCESS_PID))
    assert pid in {p.pid for p in sandbox.commands.list()}, "its process is gone"
    sandbox.commands.run(f"sha256sum -c {FILL_SUM}", timeout=120)  # raises when they differ


def test_sandboxes_cut_in_a_merge_resume_whole_and_pause_again() -> None:
    """The crash cut the merge of these paused sandboxes' memory layers (or came after some
    had finished and been adopted): each is still paused, in its layered form or its merged
    one, its checkpoint reaches the repository (the upload the crash kept from starting),
    and it resumes with its files, process and memory, and pauses and resumes again."""
    listed = {s.sandbox_id: s.state.value for s in Sandbox.list().next_items()}
    ids = in_flight_ids(HOME).get("merges", [])
    deadline = time.monotonic() + 120
    while not all(_uploaded(i) for i in ids):
        assert time.monotonic() < deadline, "the restart did not upload the paused checkpoints"
        time.sleep(0.2)
    for sandbox_id in ids:
        assert listed.get(sandbox_id) == "paused", f"{sandbox_id} is {listed.get(sandbox_id)}"
        sandbox = Sandbox.connect(sandbox_id, timeout=120)
        try:
            _assert_whole(sandbox)
            assert sandbox.pause() is True
            sandbox = Sandbox.connect(sandbox_id, timeout=120)
            _assert_whole(sandbox)
        finally:
            sandbox.kill()


def test_every_listed_snapshot_starts() -> None:
    """A snapshot the crash cut short is not listed; every one that is, starts."""
    key = {"X-API-KEY": Paths(HOME).api_key.read_text().strip()}
    snapshots = httpx.get(f"{BASE}/snapshots", headers=key, timeout=30).json()
    for snapshot in snapshots:
        sandbox = Sandbox.create(snapshot["snapshotID"], timeout=120)
        try:
            assert sandbox.commands.run("echo ok").stdout == "ok\n"
        finally:
            sandbox.kill()


def test_new_creates_work() -> None:
    fresh = Sandbox.create(timeout=60)
    try:
        assert fresh.commands.run("echo ok").stdout == "ok\n"
    finally:
        fresh.kill()
    assert not vmm_pids(fresh.sandbox_id)
