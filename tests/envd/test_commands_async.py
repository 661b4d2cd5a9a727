"""commands.* through the async SDK."""

from __future__ import annotations

import asyncio

import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    InvalidArgumentException,
    NotFoundException,
    TimeoutException,
)

from tests.envd.helpers import unique_sleep
from tests.support.wait import eventually


async def _pids(sandbox: AsyncSandbox, pattern: str) -> list[int]:
    script = (
        "for d in /proc/[0-9]*; do "
        'c=$(tr "\\0" " " < $d/cmdline 2>/dev/null) || continue; '
        'case "$c" in *"$AENV_PATTERN"*) echo ${d#/proc/};; esac; done'
    )
    result = await sandbox.commands.run(script, user="root", envs={"AENV_PATTERN": pattern})
    return [int(p) for p in result.stdout.split()]


async def test_run(async_sandbox: AsyncSandbox) -> None:
    result = await async_sandbox.commands.run("echo out; echo err >&2")
    assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "err\n", 0)


async def test_exit_code(async_sandbox: AsyncSandbox) -> None:
    with pytest.raises(CommandExitException) as info:
        await async_sandbox.commands.run("exit 7")
    assert info.value.exit_code == 7
    assert info.value.error == "exit status 7"


async def test_background_with_callbacks(async_sandbox: AsyncSandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    handle = await async_sandbox.commands.run(
        "echo a; echo b >&2; echo c",
        background=True,
        on_stdout=out.append,
        on_stderr=err.append,
    )
    result = await handle.wait()
    assert result.stdout == "a\nc\n"
    assert "".join(out) == "a\nc\n"
    assert "".join(err) == "b\n"


async def test_async_callbacks(async_sandbox: AsyncSandbox) -> None:
    seen: list[str] = []

    async def on_stdout(line: str) -> None:
        seen.append(line)

    await async_sandbox.commands.run("echo one; echo two", on_stdout=on_stdout)
    assert "".join(seen) == "one\ntwo\n"


async def test_stdin(async_sandbox: AsyncSandbox) -> None:
    handle = await async_sandbox.commands.run("cat; echo end", background=True, stdin=True)
    await async_sandbox.commands.send_stdin(handle.pid, "first\n")
    await handle.send_stdin(b"second\n")
    await async_sandbox.commands.close_stdin(handle.pid)
    assert (await handle.wait()).stdout == "first\nsecond\nend\n"


async def test_kill_and_list(async_sandbox: AsyncSandbox) -> None:
    command = unique_sleep()
    handle = await async_sandbox.commands.run(command, background=True, stdin=False)
    listed = {p.pid: p for p in await async_sandbox.commands.list()}
    assert handle.pid in listed
    assert listed[handle.pid].args == ["-l", "-c", command]
    assert await async_sandbox.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException) as info:
        await handle.wait()
    assert info.value.exit_code == -1
    assert handle.pid not in {p.pid for p in await async_sandbox.commands.list()}
    assert await async_sandbox.commands.kill(handle.pid) is False  # exited: nothing to kill
    assert await async_sandbox.commands.kill(999_999) is False


async def test_connect_running_and_exited(async_sandbox: AsyncSandbox) -> None:
    handle = await async_sandbox.commands.run(
        "read x; echo got $x; exit 2", background=True, stdin=True
    )
    await handle.disconnect()
    out: list[str] = []
    again = await async_sandbox.commands.connect(handle.pid, on_stdout=out.append)
    await async_sandbox.commands.send_stdin(handle.pid, "y\n")
    with pytest.raises(CommandExitException) as info:
        await again.wait()
    assert info.value.exit_code == 2
    assert "".join(out) == "got y\n"
    # Exited, but still within the retention window.
    late = await async_sandbox.commands.connect(handle.pid)
    with pytest.raises(CommandExitException):
        await late.wait()


async def test_connect_unknown_pid(async_sandbox: AsyncSandbox) -> None:
    with pytest.raises(NotFoundException):
        await async_sandbox.commands.connect(999_999)


async def test_too_short_timeout(async_sandbox: AsyncSandbox) -> None:
    command = unique_sleep()
    with pytest.raises(TimeoutException):
        await async_sandbox.commands.run(f"{command}; echo never", timeout=1)

    async def ended() -> bool:
        return not await _pids(async_sandbox, command)

    await eventually(ended, "the timed-out command ended", interval=0.05)


async def test_env_cwd_user(async_sandbox: AsyncSandbox) -> None:
    result = await async_sandbox.commands.run(
        'echo "$X"; pwd; id -un', envs={"X": "x-value"}, cwd="/tmp", user="root"
    )
    assert result.stdout == "x-value\n/tmp\nroot\n"
    with pytest.raises(InvalidArgumentException):
        await async_sandbox.commands.run("true", cwd="/does/not/exist")


async def test_concurrent_runs(async_sandbox: AsyncSandbox) -> None:
    results = await asyncio.gather(*(async_sandbox.commands.run(f"echo {i}") for i in range(50)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(50)]


async def test_background_server_does_not_block(async_sandbox: AsyncSandbox) -> None:
    command = unique_sleep()
    result = await async_sandbox.commands.run(f"{command} & echo $!")
    pid = int(result.stdout)
    try:
        assert pid in await _pids(async_sandbox, command)
    finally:
        await async_sandbox.commands.run(f"kill {pid}")


async def test_large_output(async_sandbox: AsyncSandbox) -> None:
    size = 20 * 1024 * 1024
    result = await async_sandbox.commands.run(f"head -c {size} /dev/zero | tr '\\0' x")
    assert len(result.stdout) == size
    assert set(result.stdout) == {"x"}


async def test_stream_input(async_sandbox: AsyncSandbox) -> None:
    handle = await async_sandbox.commands.run("cat", background=True, stdin=True)
    stream = async_sandbox.commands.stream_input(handle.pid)
    for part in ("one\n", b"two\n", "three\n"):
        await stream.send(part)
    await stream.close()
    await async_sandbox.commands.close_stdin(handle.pid)
    assert (await handle.wait()).stdout == "one\ntwo\nthree\n"


async def test_stream_input_to_unknown_pid(async_sandbox: AsyncSandbox) -> None:
    stream = async_sandbox.commands.stream_input(999_999)
    with pytest.raises(NotFoundException):
        await stream.send("x")
        await stream.close()


async def test_pty_stream_input(async_sandbox: AsyncSandbox) -> None:
    from e2b.sandbox.commands.command_handle import PtySize

    out: list[bytes] = []
    handle = await async_sandbox.pty.create(PtySize(rows=24, cols=80), on_data=out.append)
    stream = async_sandbox.pty.stream_input(handle.pid)
    await stream.send(b"echo streamed-$((20+22))\n")
    await stream.send(b"exit\n")
    await stream.close()
    await handle.wait()
    assert "streamed-42" in b"".join(out).decode(errors="replace")
