"""The node ends VMMs of its own that no server of it runs any more, at start and on every
reconciliation: a real QEMU naming the node's files, left as a server killed with kill -9 leaves
it when a subreaper adopts its VMMs (its parent is then neither this process nor init, so the
start-up sweep of init's orphans does not see it)."""

from __future__ import annotations

import contextlib
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.doubles.node import double_node
from tests.support.wait import SAFETY_S, eventually_sync


@contextlib.contextmanager
def stray_vmm(home: Path) -> Iterator[psutil.Process]:
    """A QEMU of the node at `home` under a shell that `setsid -f` detached from this process;
    the shell and QEMU are killed on exit whatever happened."""
    name = f"aenv-{secrets.token_hex(8)}"
    pid_file = home / f"{name}.pid"
    qemu = (
        f"qemu-system-x86_64 -M microvm -S -display none -nodefaults -name {name} "
        f"-qmp unix:{home}/qmp.{name}.sock,server=on,wait=off"
    )
    subprocess.run(
        ["setsid", "-f", "sh", "-c", f"{qemu} >/dev/null 2>&1 & echo $! > {pid_file}; wait"],
        check=True,
    )
    eventually_sync(
        lambda: pid_file.exists() and pid_file.read_text().strip(), "the stray VMM started"
    )
    proc = psutil.Process(int(pid_file.read_text()))
    shell = proc.parent()
    assert shell is not None
    try:
        eventually_sync(lambda: name in " ".join(proc.cmdline()), "the shell exec'd QEMU")
        yield proc
    finally:
        for p in (proc, shell):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


@pytest.fixture
def home() -> Iterator[Path]:
    """A data dir with a short path: QEMU exits at once when its QMP socket's path passes the
    107 bytes of AF_UNIX, as a pytest-xdist worker's tmp_path made it."""
    directory = Path(tempfile.mkdtemp(prefix="aenv-rc-"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory)


def gone(proc: psutil.Process) -> bool:
    try:
        proc.wait(timeout=SAFETY_S)
    except psutil.TimeoutExpired:
        return False
    return True


async def test_reconcile_kills_a_vmm_of_this_node_that_it_did_not_start(
    home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with double_node(home) as node:
        record, _ = await node.orchestrator.create(node.request())
        with stray_vmm(home) as stray:
            assert stray.ppid() not in (1, psutil.Process().pid)
            await node.orchestrator.reconcile()
            assert gone(stray)
            assert "killed 1 VMMs of this node" in caplog.text
        # The node's own sandbox is untouched.
        assert node.orchestrator.guest_endpoint(record.id)
        await node.orchestrator.kill(record.id)


async def test_start_kills_a_vmm_a_killed_server_of_this_node_left(home: Path) -> None:
    other = home / "other-node"
    other.mkdir()
    node = home / "node"
    node.mkdir()
    with stray_vmm(node) as stray, stray_vmm(other) as foreign:
        async with double_node(node):
            assert gone(stray)
            assert foreign.is_running()  # another node's VMM is not this node's to end
