"""pty.* through the sync and async SDKs: create, input, resize, connect, kill."""

from __future__ import annotations

import pytest
from e2b import AsyncSandbox, CommandExitException, Sandbox
from e2b.sandbox.commands.command_handle import PtySize

from tests.envd.helpers import pids_in_sandbox, unique_sleep
from tests.support.wait import eventually_sync


def _collect(handle_output: list[bytes]) -> str:
    return b"".join(handle_output).decode(errors="replace")


def test_pty_runs_interactive_shell(sandbox: Sandbox) -> None:
    handle = sandbox.pty.create(PtySize(rows=24, cols=80))
    sandbox.pty.send_stdin(handle.pid, b"echo $((6*7)); tty; id -un; exit\n")
    out: list[bytes] = []
    result = handle.wait(on_pty=out.append)
    assert result.exit_code == 0
    text = _collect(out)
    assert "42" in text
    assert "/dev/pts/" in text
    assert "user" in text


def test_pty_env_defaults(sandbox: Sandbox) -> None:
    handle = sandbox.pty.create(PtySize(rows=24, cols=80), envs={"EXTRA": "x1y2"})
    sandbox.pty.send_stdin(handle.pid, b'echo "[$TERM][$EXTRA]"; exit\n')
    out: list[bytes] = []
    handle.wait(on_pty=out.append)
    assert "[xterm-256color][x1y2]" in _collect(out)


def test_pty_resize_visible_to_stty(sandbox: Sandbox) -> None:
    handle = sandbox.pty.create(PtySize(rows=24, cols=80))
    sandbox.pty.resize(handle.pid, PtySize(rows=33, cols=111))
    sandbox.pty.send_stdin(handle.pid, b"stty size; exit\n")
    out: list[bytes] = []
    handle.wait(on_pty=out.append)
    assert "33 111" in _collect(out)


def test_pty_initial_size(sandbox: Sandbox) -> None:
    handle = sandbox.pty.create(PtySize(rows=17, cols=61), user="root", cwd="/tmp")
    sandbox.pty.send_stdin(handle.pid, b"stty size; pwd; id -un; exit\n")
    out: list[bytes] = []
    handle.wait(on_pty=out.append)
    text = _collect(out)
    assert "17 61" in text
    assert "/tmp" in text
    assert "root" in text


def test_pty_kill(sandbox: Sandbox) -> None:
    handle = sandbox.pty.create(PtySize(rows=24, cols=80))
    assert sandbox.pty.kill(handle.pid) is True
    with pytest.raises(CommandExitException) as info:
        handle.wait()
    assert info.value.exit_code == -1
    assert sandbox.pty.kill(999_999) is False


def test_pty_connect_after_disconnect(sandbox: Sandbox) -> None:
    handle = sandbox.pty.create(PtySize(rows=24, cols=80))
    handle.disconnect()
    again = sandbox.pty.connect(handle.pid)
    sandbox.pty.send_stdin(handle.pid, b"echo reattached-$((1+1)); exit\n")
    out: list[bytes] = []
    again.wait(on_pty=out.append)
    assert "reattached-2" in _collect(out)


def test_pty_ctrl_c_interrupts_foreground_job(sandbox: Sandbox) -> None:
    handle = sandbox.pty.create(PtySize(rows=24, cols=80))
    command = unique_sleep()
    sandbox.pty.send_stdin(handle.pid, f"{command}\n".encode())
    eventually_sync(lambda: pids_in_sandbox(sandbox, command))
    sandbox.pty.send_stdin(handle.pid, b"\x03")
    sandbox.pty.send_stdin(handle.pid, b"echo after-$((2+3)); exit\n")
    out: list[bytes] = []
    handle.wait(on_pty=out.append)
    assert "after-5" in _collect(out)


async def test_pty_async(async_sandbox: AsyncSandbox) -> None:
    out: list[bytes] = []
    handle = await async_sandbox.pty.create(PtySize(rows=24, cols=80), on_data=out.append)
    await async_sandbox.pty.resize(handle.pid, PtySize(rows=40, cols=120))
    await async_sandbox.pty.send_stdin(handle.pid, b"stty size; echo $((3*4)); exit\n")
    result = await handle.wait()
    assert result.exit_code == 0
    text = _collect(out)
    assert "40 120" in text
    assert "12" in text


async def test_pty_async_kill(async_sandbox: AsyncSandbox) -> None:
    handle = await async_sandbox.pty.create(PtySize(rows=24, cols=80), on_data=lambda _: None)
    assert await async_sandbox.pty.kill(handle.pid) is True
    with pytest.raises(CommandExitException):
        await handle.wait()
