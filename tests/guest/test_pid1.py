"""`aenv-init`, the guest's PID 1, built as the initramfs build does and run here as PID 1 of a
fresh PID namespace: it reaps orphans, passes signals and its program's status on, and never
wakes while nothing happens (tini woke once a second)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from aenv.guest.pid1 import build_pid1
from tests.support.wait import eventually_sync


@pytest.fixture(scope="module")
async def init(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return await build_pid1(tmp_path_factory.mktemp("pid1"))


def as_pid1(init: Path, script: str) -> subprocess.Popen[str]:
    """`init` running `sh -c script` as PID 1 of a new PID namespace (with its own /proc)."""
    argv = [
        "unshare",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
        str(init),
        "--",
        "sh",
        "-c",
        script,
    ]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_orphans_are_reaped_and_the_status_passed_on(
    init: Path, started: list[subprocess.Popen[str]]
) -> None:
    # Two orphans (re-parented to PID 1 once their subshells exit) exit while the program runs;
    # it then lists its namespace's zombies.
    script = "(sleep 0.2 &); (sleep 0.2 &); sleep 1; ps -o stat= -e | grep -c Z; exit 3"
    started.append(proc := as_pid1(init, script))
    out, _ = proc.communicate(timeout=30)
    assert out.strip() == "0" and proc.returncode == 3


def test_signals_reach_the_program_and_idle_means_no_wakeup(
    init: Path, started: list[subprocess.Popen[str]]
) -> None:
    started.append(proc := as_pid1(init, "trap 'exit 42' TERM; while :; do sleep 1; done"))
    pid1 = eventually_sync(lambda: _init_of(proc.pid), "aenv-init started")
    # The program's `sleep` children exit once a second, so count only what no child causes:
    # a second program that just waits shows PID 1's own wakeups.
    started.append(idle := as_pid1(init, "exec sleep 600"))
    idle_init = eventually_sync(lambda: _init_of(idle.pid), "the idle aenv-init started")
    before = idle_init.num_ctx_switches()
    time.sleep(3)
    assert idle_init.num_ctx_switches() == before  # tini: 3 voluntary switches here
    pid1.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 42


def _init_of(unshare_pid: int) -> psutil.Process | None:
    """The init below `unshare --fork` (its child), once it has exec'd."""
    for child in psutil.Process(unshare_pid).children():
        if child.name() == "aenv-init":
            return child
    return None
