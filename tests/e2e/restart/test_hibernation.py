"""Idle hibernation on real VMs, against a server started with `AENV_HIBERNATE_AFTER=2`
(test_server.py): an idle sandbox's VM is stopped while the API shows it running, the next
request wakes it with its files and a process's memory as they were, a sandbox with an open
command stream stays awake, and a hibernated sandbox's timeout keeps counting."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import NotFoundException

from tests.e2e.restart.in_flight import catalog_states
from tests.e2e.vmm_procs import vmm_sandbox_ids
from tests.support.wait import eventually_sync

HOME = Path(os.environ["AENV_HOME"])
# A process outside envd's table (a command that left it behind, reparented to PID 1) holding
# a random value in memory only; on SIGUSR1 it writes that value to /tmp/value.
KEEPER = (
    'setsid sh -c \'v=$(head -c 8 /dev/urandom | od -An -tx1 | tr -d " \\n"); '
    'trap "echo $v > /tmp/value" USR1; echo $v > /tmp/first; echo $$ > /tmp/pid; '
    "while true; do sleep 1; done' > /dev/null 2>&1 < /dev/null &"
)


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    sbx = Sandbox.create(timeout=300)
    try:
        yield sbx
    finally:
        sbx.kill()


def internal_state(sandbox_id: str) -> str | None:
    return (catalog_states(HOME) or {}).get(sandbox_id)


def test_idle_sandbox_hibernates_and_wakes_with_files_and_memory(sandbox: Sandbox) -> None:
    sandbox.files.write("/home/user/kept.txt", "before hibernation")
    sandbox.commands.run(KEEPER)
    sandbox.commands.run("while [ ! -s /tmp/pid ]; do sleep 0.05; done", timeout=60)
    pid = sandbox.files.read("/tmp/pid").strip()
    value = sandbox.files.read("/tmp/first").strip()
    sandbox.commands.run("rm /tmp/first")  # from now on, only the process's memory holds it

    eventually_sync(
        lambda: internal_state(sandbox.sandbox_id) == "hibernated", "hibernation", interval=0.2
    )
    assert sandbox.sandbox_id not in vmm_sandbox_ids(HOME)  # its VMM is gone
    assert Sandbox.get_info(sandbox.sandbox_id).state.value == "running"
    running = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING])).next_items()
    assert sandbox.sandbox_id in {s.sandbox_id for s in running}

    # The next request wakes it: the same files and the same process, its memory intact.
    assert sandbox.files.read("/home/user/kept.txt") == "before hibernation"
    assert internal_state(sandbox.sandbox_id) == "running"
    sandbox.commands.run(f"kill -USR1 {pid}")
    sandbox.commands.run("while [ ! -s /tmp/value ]; do sleep 0.1; done", timeout=60)
    assert sandbox.files.read("/tmp/value").strip() == value


def test_open_command_stream_keeps_it_awake() -> None:
    busy = Sandbox.create(timeout=300)
    idle: Sandbox | None = None
    try:
        stream = busy.commands.run("sleep 600", background=True)
        idle = Sandbox.create(timeout=300)
        # The idle one, created after, hibernates; then one more look at both has passed.
        eventually_sync(
            lambda: internal_state(idle.sandbox_id) == "hibernated", "hibernation", interval=0.2
        )
        time.sleep(2)
        assert internal_state(busy.sandbox_id) == "running"
        assert busy.sandbox_id in vmm_sandbox_ids(HOME)
        stream.kill()

        # A hibernated sandbox's timeout counts as a running one's: it ends.
        Sandbox.set_timeout(idle.sandbox_id, 1)
        eventually_sync(
            lambda: idle.sandbox_id not in (catalog_states(HOME) or {}), "the timeout", interval=0.2
        )
        with pytest.raises(NotFoundException):
            Sandbox.get_info(idle.sandbox_id)
    finally:
        busy.kill()
        if idle is not None:
            Sandbox.kill(idle.sandbox_id)
