"""commands.* through the sync SDK: run, background, stdin, kill, list, connect, timeouts, env,
cwd, users, exit codes, large output."""

from __future__ import annotations

import hashlib

import pytest
from e2b import (
    CommandExitException,
    InvalidArgumentException,
    NotFoundException,
    Sandbox,
    TimeoutException,
)

from tests.envd.helpers import pids_in_sandbox, unique_sleep
from tests.support.wait import eventually_sync


def test_run_collects_stdout_stderr_and_exit_code(sandbox: Sandbox) -> None:
    result = sandbox.commands.run("echo out; echo err >&2")
    assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "err\n", 0)
    assert result.error is None


def test_run_streams_to_callbacks(sandbox: Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    sandbox.commands.run(
        "for i in 1 2 3; do echo o$i; echo e$i >&2; done",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert "".join(out) == "o1\no2\no3\n"
    assert "".join(err) == "e1\ne2\ne3\n"


def test_nonzero_exit_raises_command_exit_exception(sandbox: Sandbox) -> None:
    with pytest.raises(CommandExitException) as info:
        sandbox.commands.run("echo partial; echo oops >&2; exit 3")
    e = info.value
    assert (e.exit_code, e.stdout, e.stderr) == (3, "partial\n", "oops\n")
    assert e.error == "exit status 3"


def test_command_not_found_is_exit_127(sandbox: Sandbox) -> None:
    with pytest.raises(CommandExitException) as info:
        sandbox.commands.run("definitely-not-a-command-xyz")
    assert info.value.exit_code == 127
    assert "not found" in info.value.stderr


def test_stdin_is_closed_by_default(sandbox: Sandbox) -> None:
    # `cat` would block forever on an open stdin; the SDK sends stdin=false.
    assert sandbox.commands.run("cat; echo eof").stdout == "eof\n"


def test_background_then_wait(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("echo started; sleep 0.2; echo done", background=True)
    assert handle.pid > 0
    result = handle.wait()
    assert result.stdout == "started\ndone\n"
    assert result.exit_code == 0


def test_send_stdin_and_close_stdin(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("cat; echo closed", background=True, stdin=True)
    sandbox.commands.send_stdin(handle.pid, "hello ")
    handle.send_stdin(b"world\n")
    sandbox.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "hello world\nclosed\n"


def test_stream_input(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("cat", background=True, stdin=True)
    chunks: list[str | bytes] = ["a\n", b"b\n", "c\n"]
    sandbox.commands.stream_input(handle.pid, iter(chunks))
    handle.close_stdin()
    assert handle.wait().stdout == "a\nb\nc\n"


def test_kill_background_command(sandbox: Sandbox) -> None:
    marker = unique_sleep()
    handle = sandbox.commands.run(f"{marker}; echo never", background=True)
    eventually_sync(lambda: pids_in_sandbox(sandbox, marker))
    assert sandbox.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException) as info:
        handle.wait()
    assert info.value.exit_code == -1
    assert info.value.error == "signal: killed"
    assert handle.pid not in [p.pid for p in sandbox.commands.list()]
    assert not pids_in_sandbox(sandbox, marker)


def test_kill_via_handle(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("sleep 1000", background=True)
    assert handle.kill() is True
    with pytest.raises(CommandExitException):
        handle.wait()


def test_kill_unknown_pid_returns_false(sandbox: Sandbox) -> None:
    assert sandbox.commands.kill(999_999) is False


def test_list_shows_running_commands(sandbox: Sandbox, workdir: str) -> None:
    handle = sandbox.commands.run(
        "sleep 1000", background=True, envs={"LISTED": "yes"}, cwd=workdir
    )
    try:
        found = [p for p in sandbox.commands.list() if p.pid == handle.pid]
        assert len(found) == 1
        info = found[0]
        assert info.cmd == "/bin/bash"
        assert info.args == ["-l", "-c", "sleep 1000"]
        assert info.envs == {"LISTED": "yes"}
        assert info.cwd == workdir
    finally:
        handle.kill()


def test_connect_to_running_command(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("read line; echo got $line", background=True, stdin=True)
    handle.disconnect()
    # Disconnecting must not kill it: reattach and feed it.
    again = sandbox.commands.connect(handle.pid)
    assert again.pid == handle.pid
    sandbox.commands.send_stdin(handle.pid, "x\n")
    assert again.wait().stdout == "got x\n"


def test_connect_to_exited_command_within_retention(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("echo bye; exit 4", background=True)
    with pytest.raises(CommandExitException):
        handle.wait()
    late = sandbox.commands.connect(handle.pid)
    with pytest.raises(CommandExitException) as info:
        late.wait()
    assert info.value.exit_code == 4


def test_connect_unknown_pid_is_not_found(sandbox: Sandbox) -> None:
    with pytest.raises(NotFoundException):
        sandbox.commands.connect(999_999)


def test_too_short_timeout_raises_and_kills(sandbox: Sandbox) -> None:
    marker = unique_sleep()
    with pytest.raises(TimeoutException):
        sandbox.commands.run(f"{marker}; echo never", timeout=1)
    # The deadline bounds the process too: envd kills it, it does not linger.
    eventually_sync(lambda: not pids_in_sandbox(sandbox, marker))
    assert all(marker not in " ".join(p.args) for p in sandbox.commands.list())


def test_timeout_zero_means_unbounded(sandbox: Sandbox) -> None:
    assert sandbox.commands.run("sleep 1.5; echo ok", timeout=0).stdout == "ok\n"


def test_background_server_does_not_block_run(sandbox: Sandbox) -> None:
    marker = unique_sleep()
    result = sandbox.commands.run(f"{marker} & echo $!", timeout=30)
    assert result.exit_code == 0
    pid = int(result.stdout)
    try:
        # The server outlives the command that started it.
        assert pid in pids_in_sandbox(sandbox, marker)
    finally:
        sandbox.commands.run(f"kill {pid}")


def test_request_envs(sandbox: Sandbox) -> None:
    result = sandbox.commands.run('echo "$FOO|$BAR"', envs={"FOO": "foo", "BAR": "b a r"})
    assert result.stdout == "foo|b a r\n"


def test_base_env(sandbox: Sandbox) -> None:
    out = sandbox.commands.run('echo "$HOME|$USER|$LOGNAME"; echo "$PATH"').stdout.splitlines()
    assert out[0] == "/home/user|user|user"
    assert "/usr/bin" in out[1].split(":")


def test_request_envs_override_base(sandbox: Sandbox) -> None:
    result = sandbox.commands.run('echo "$LOGNAME"', envs={"LOGNAME": "override"})
    assert result.stdout == "override\n"


def test_default_cwd_is_home(sandbox: Sandbox) -> None:
    assert sandbox.commands.run("pwd").stdout == "/home/user\n"


def test_cwd(sandbox: Sandbox, workdir: str) -> None:
    assert sandbox.commands.run("pwd", cwd=workdir).stdout == f"{workdir}\n"
    assert sandbox.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"


def test_relative_cwd_is_under_home(sandbox: Sandbox, workdir: str) -> None:
    relative = workdir.removeprefix("/home/user/")
    assert sandbox.commands.run("pwd", cwd=relative).stdout == f"{workdir}\n"


def test_nonexistent_cwd_is_invalid_argument(sandbox: Sandbox) -> None:
    with pytest.raises(InvalidArgumentException) as info:
        sandbox.commands.run("pwd", cwd="/no/such/dir")
    assert "cwd '/no/such/dir' does not exist" in str(info.value)


def test_users(sandbox: Sandbox) -> None:
    assert sandbox.commands.run("id -un").stdout == "user\n"
    assert sandbox.commands.run("id -u; id -g", user="user").stdout == "1000\n1000\n"
    root = sandbox.commands.run('id -un; echo "$HOME"; pwd', user="root")
    assert root.stdout == "root\n/root\n/root\n"


def test_large_output_is_streamed_completely(sandbox: Sandbox) -> None:
    size = 50 * 1024 * 1024
    produce = f"yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c {size}"
    expected = sandbox.commands.run(f"{produce} | sha256sum").stdout.split()[0]
    chunks = 0

    def count(_: str) -> None:
        nonlocal chunks
        chunks += 1

    result = sandbox.commands.run(produce, on_stdout=count, timeout=300)
    assert len(result.stdout) == size
    assert hashlib.sha256(result.stdout.encode()).hexdigest() == expected
    assert chunks > 1  # delivered as a stream, not one message


def test_many_sequential_runs(sandbox: Sandbox) -> None:
    for i in range(30):
        assert sandbox.commands.run(f"echo {i}").stdout == f"{i}\n"


def test_utf8_output_split_across_chunks(sandbox: Sandbox) -> None:
    text = "žluťoučký kůň 🐎 " * 20000
    result = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(result.pid, text)
    sandbox.commands.close_stdin(result.pid)
    assert result.wait().stdout == text


def test_exited_command_cannot_be_killed_or_fed(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("true", background=True, stdin=True)
    handle.wait()
    # Still connectable for a while, but there is nothing left to signal or to write to.
    assert sandbox.commands.kill(handle.pid) is False
    with pytest.raises(NotFoundException):
        sandbox.commands.send_stdin(handle.pid, "late")
    assert sandbox.commands.connect(handle.pid).wait().exit_code == 0


def test_large_stdin_and_large_command(sandbox: Sandbox) -> None:
    payload = "0123456789abcdef\n" * (8 * 1024 * 1024 // 17)  # ~8 MB in one SendInput
    handle = sandbox.commands.run("sha256sum", background=True, stdin=True)
    sandbox.commands.send_stdin(handle.pid, payload)
    sandbox.commands.close_stdin(handle.pid)
    assert handle.wait().stdout.split()[0] == hashlib.sha256(payload.encode()).hexdigest()
    # A command line over the kernel's limit for one argument (128 KiB) cannot be executed.
    with pytest.raises(InvalidArgumentException) as info:
        sandbox.commands.run("echo " + "x" * (256 * 1024))
    assert "Argument list too long" in str(info.value)
    assert sandbox.commands.run("echo still").stdout == "still\n"
