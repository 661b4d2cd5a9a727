"""The spare Python kernel: a new context takes it instead of waiting for a kernel to start,
in the directory it asks for, and a new spare starts; a spare taken in a clone is reseeded; a
start cancelled (a server closing) leaves no kernel process behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
from e2b_code_interpreter import Sandbox

from aenv.code_interpreter import execution, incarnation
from aenv.code_interpreter.kernel import start as start_kernel
from aenv.code_interpreter.kernels import ContextTable
from aenv.code_interpreter.sandbox_env import SandboxEnv
from tests.code_interpreter.conftest import running_server

_REFILL_TIMEOUT_S = 120.0


def _kernels(server_pid: int) -> set[int]:
    children = psutil.Process(server_pid).children()
    return {p.pid for p in children if "ipykernel_launcher" in " ".join(p.cmdline())}


def test_a_new_context_takes_the_spare_and_another_starts(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    with running_server(tmp_path) as (url, pid):
        sandbox = Sandbox.create(debug=True, sandbox_url=url)
        # The default kernel and the spare, both ready before the server answered.
        started = _kernels(pid)
        assert len(started) == 2
        context = sandbox.create_code_context(cwd=str(work))
        getpid = "import os; (os.getpid(), os.getcwd())"
        text = sandbox.run_code(getpid, context=context).text
        assert text is not None
        kernel_pid, cwd = text.strip("()").split(", ")
        assert int(kernel_pid) in started
        assert cwd == repr(str(work))
        # The default context is the other one of the two, still in the server's directory.
        text = sandbox.run_code(getpid).text
        assert text is not None and text.endswith(f"{str(tmp_path)!r})")
        _wait_for_kernels(pid, 3)
        # The next context takes the refill, in the default directory, and another starts.
        refill = _kernels(pid) - started
        second = sandbox.create_code_context()
        text = sandbox.run_code(getpid, context=second).text
        assert text == f"({refill.pop()}, {str(tmp_path)!r})"
        _wait_for_kernels(pid, 4)


def _wait_for_kernels(server_pid: int, count: int) -> None:
    deadline = time.monotonic() + _REFILL_TIMEOUT_S
    while len(_kernels(server_pid)) < count:
        assert time.monotonic() < deadline, "no new spare started"
        time.sleep(0.5)


@pytest.fixture
async def table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ContextTable]:
    """A context table whose spare started in the sandbox `template-vm`, restored as `clone-1`
    (the node gave the sandbox another hostname)."""
    monkeypatch.setattr(incarnation, "current", lambda: "template-vm")
    table = ContextTable(str(tmp_path))
    try:
        table.spares.fill()
        await table.spares.ready()
        monkeypatch.setattr(incarnation, "current", lambda: "clone-1")
        yield table
    finally:
        await table.close()


async def test_a_spare_taken_in_another_sandbox_is_reseeded(table: ContextTable) -> None:
    context = await table.create()
    assert context.kernel.incarnation == "template-vm"
    lines = [
        json.loads(line)
        async for line in execution.run(context, "1 + 1", {}, SandboxEnv(None), None)
    ]
    assert any(line.get("text") == "2" for line in lines), lines
    assert context.kernel.incarnation == "clone-1"


async def test_a_directory_the_kernel_cannot_enter_is_refused_and_the_spare_kept(
    table: ContextTable, tmp_path: Path
) -> None:
    with pytest.raises(FileNotFoundError):
        await table.create(cwd=str(tmp_path / "missing"))
    assert table.list() == []
    # The spare is still there for the next context.
    context = await table.create(cwd=str(tmp_path))
    assert (context.cwd, context.kernel.incarnation) == (str(tmp_path), "template-vm")


async def test_without_spares_a_context_starts_its_own_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = ContextTable(str(tmp_path), spares=False)
    try:
        table.spares.fill()
        await table.spares.ready()
        monkeypatch.setattr(incarnation, "current", lambda: "at-create")
        context = await table.create(cwd=str(tmp_path))
        # Started for this context, in its directory: not a spare made before.
        assert context.kernel.incarnation == "at-create"
        lines = [
            json.loads(line)
            async for line in execution.run(context, "1 + 1", {}, SandboxEnv(None), None)
        ]
        assert any(line.get("text") == "2" for line in lines), lines
    finally:
        await table.close()


async def test_a_start_cancelled_after_its_process_launched_leaves_no_process(
    tmp_path: Path,
) -> None:
    """What a server closing does to a spare still starting: the kernel's process is gone."""
    me = psutil.Process()
    before = _kernels(me.pid)
    start = asyncio.create_task(start_kernel("python", str(tmp_path)))
    # The launch runs in the event loop; this task runs at the first await after it, which
    # is still inside jupyter_client's start.
    while not (launched := _kernels(me.pid) - before):
        await asyncio.sleep(0)
    (pid,) = launched
    try:
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()
