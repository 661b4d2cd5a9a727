"""Clients that leave mid-stream: processes are neither leaked nor killed by it, envd leaks no
fds, a slow reader bounds envd's memory instead of growing it."""

from __future__ import annotations

import httpx
import pytest
from e2b import AsyncSandbox, CommandExitException, NotFoundException, Sandbox

from tests.envd.helpers import (
    STREAM_HEADERS,
    envelope,
    extra_envd,
    pids_in_sandbox,
    sandbox_for,
    unique_sleep,
)
from tests.support.wait import eventually_sync


def _envd_status(sandbox: Sandbox, field: str) -> int:
    # envd is PID 1 of the throwaway root's PID namespace.
    out = sandbox.commands.run(f"grep '^{field}:' /proc/1/status", user="root").stdout
    return int(out.split()[1])


def _envd_fds(sandbox: Sandbox) -> int:
    return int(sandbox.commands.run("ls /proc/1/fd | wc -l", user="root").stdout)


def _zombies(sandbox: Sandbox) -> list[str]:
    script = (
        "for s in /proc/[0-9]*/stat; do read -r l < $s && case $l in *') Z '*) echo $l;; esac; done"
    )
    return sandbox.commands.run(script, user="root").stdout.splitlines()


def _start_stream(url: str, command: str) -> tuple[httpx.Client, httpx.Response]:
    client = httpx.Client(base_url=url, timeout=60)
    request = client.build_request(
        "POST",
        "/process.Process/Start",
        content=envelope(
            {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", command]}, "stdin": False}
        ),
        headers=STREAM_HEADERS,
    )
    return client, client.send(request, stream=True)


def test_disconnect_from_run_keeps_the_process(sandbox: Sandbox, envd_url: str) -> None:
    command = unique_sleep()
    client, response = _start_stream(envd_url, command)
    next(response.iter_raw())  # the start event: it is running
    response.close()
    client.close()
    # Leaving the stream does not kill the command (reconnect with Connect to follow it).
    pids = eventually_sync(lambda: pids_in_sandbox(sandbox, command))
    listed = [p for p in sandbox.commands.list() if p.args[-1:] == [command]]
    assert len(listed) == 1
    assert sandbox.commands.kill(listed[0].pid)
    eventually_sync(lambda: not any(p in pids_in_sandbox(sandbox, command) for p in pids))


def test_background_handle_disconnect_then_kill(sandbox: Sandbox) -> None:
    command = unique_sleep()
    handle = sandbox.commands.run(command, background=True)
    handle.disconnect()
    assert handle.pid in {p.pid for p in sandbox.commands.list()}
    assert sandbox.commands.kill(handle.pid)
    eventually_sync(lambda: not pids_in_sandbox(sandbox, command))
    eventually_sync(lambda: not _zombies(sandbox))


def test_no_fd_leak_across_many_streams(sandbox: Sandbox, envd_url: str) -> None:
    for _ in range(3):  # warm up lazily opened fds
        sandbox.commands.run("true")
    before = _envd_fds(sandbox)
    for i in range(40):
        if i % 2:
            sandbox.commands.run(f"echo {i}")
        else:
            client, response = _start_stream(envd_url, f"echo {i}; sleep 0.05")
            next(response.iter_raw())
            response.close()
            client.close()
        handle = sandbox.files.watch_dir("/tmp")
        handle.stop()
    # Every process has exited and every stream is gone: envd holds what it held before.
    eventually_sync(lambda: _envd_fds(sandbox) <= before + 2)
    assert not _zombies(sandbox)


def test_slow_reader_bounds_memory_and_process_finishes(sandbox: Sandbox, envd_url: str) -> None:
    baseline = _envd_status(sandbox, "VmRSS")  # kB
    size = 512 * 1024 * 1024
    marker = unique_sleep().removeprefix("sleep ")
    # A command producing far more output than envd may buffer, whose client stops reading.
    command = f"head -c {size} /dev/zero; : {marker}"
    client, response = _start_stream(envd_url, command)
    chunks = response.iter_raw()
    next(chunks)
    eventually_sync(lambda: pids_in_sandbox(sandbox, marker))
    # The command stays blocked on its full pipe while nobody reads; envd does not buffer it.
    for _ in range(5):
        assert pids_in_sandbox(sandbox, marker)
        assert _envd_status(sandbox, "VmRSS") < baseline + 128 * 1024
    # The client leaves: output is no longer held for it, so the command runs to completion.
    response.close()
    client.close()
    eventually_sync(lambda: not pids_in_sandbox(sandbox, marker))
    assert _envd_status(sandbox, "VmRSS") < baseline + 128 * 1024


def test_exited_process_is_forgotten_after_retention() -> None:
    with extra_envd("--process-retention", "0.5") as url:
        sandbox = sandbox_for(url)
        handle = sandbox.commands.run("exit 5", background=True)
        with pytest.raises(CommandExitException):
            handle.wait()

        def forgotten() -> bool:
            try:
                sandbox.commands.connect(handle.pid).wait()
            except NotFoundException:
                return True
            except CommandExitException as e:
                assert e.exit_code == 5  # still retained: reports how it ended
            return False

        eventually_sync(forgotten)
        assert sandbox.commands.kill(handle.pid) is False


def test_upload_abandoned_mid_body_leaves_nothing(
    sandbox: Sandbox, envd_url: str, workdir: str
) -> None:
    import socket
    from urllib.parse import quote, urlsplit

    target = f"{workdir}/abandoned.bin"
    host, port = urlsplit(envd_url).hostname, urlsplit(envd_url).port
    assert host is not None and port is not None
    with socket.create_connection((host, port)) as s:
        s.sendall(
            (
                f"POST /files?path={quote(target)} HTTP/1.1\r\nHost: {host}\r\n"
                "Content-Type: application/octet-stream\r\n"
                f"Content-Length: {10 * 1024 * 1024}\r\n\r\n"
            ).encode()
            + b"x" * (1024 * 1024)
        )
        eventually_sync(lambda: sandbox.files.exists(target))  # it started writing
    # The client is gone mid-body: the half-written file is removed, envd keeps serving.
    eventually_sync(lambda: not sandbox.files.exists(target))
    assert sandbox.commands.run("echo fine").stdout == "fine\n"


async def test_concurrent_uploads_and_downloads(async_sandbox: AsyncSandbox) -> None:
    import asyncio
    import os

    base = "/home/user/concurrent"
    blobs = {f"{base}/f{i}.bin": os.urandom(256 * 1024 + i) for i in range(16)}
    await asyncio.gather(*(async_sandbox.files.write(p, d) for p, d in blobs.items()))
    read = await asyncio.gather(*(async_sandbox.files.read(p, format="bytes") for p in blobs))
    assert [bytes(r) for r in read] == list(blobs.values())
    await async_sandbox.files.remove(base)


def test_many_concurrent_commands_under_a_low_fd_limit() -> None:
    """envd raises its soft fd limit (like Go's runtime does for infra's envd): started with a
    soft limit of 256, it still runs far more concurrent commands than that would allow."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 4096:
        pytest.skip("the hard fd limit is too low for this check")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # inherited by the envd we start
    try:
        with extra_envd() as url:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            sandbox = sandbox_for(url)
            handles = [sandbox.commands.run("sleep 1000", background=True) for _ in range(150)]
            assert len({h.pid for h in handles}) == 150
            assert sandbox.commands.run("echo ok").stdout == "ok\n"
            for handle in handles:
                handle.kill()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
