"""The official e2b SDK, configured as after a create against our server (everything to one URL,
the sandbox named by `E2b-Sandbox-Id`/`-Port`), talking to our real envd through the proxy."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import uuid

import httpx
import pytest
from e2b import (
    AuthenticationException,
    CommandResult,
    FilesystemEvent,
    FilesystemEventType,
    Sandbox,
    SandboxNotRunningException,
    SandboxUnreachableException,
)
from e2b.sandbox.commands.command_handle import PtySize

from tests.proxy.conftest import (
    DOMAIN,
    ENVD,
    ENVD_SANDBOX,
    async_sdk_sandbox,
    sdk_sandbox,
)
from tests.proxy.support import WAIT, DictResolver, FakeSandbox
from tests.support.envd_process import envd_in_throwaway_root
from tests.support.ports import free_port


def test_commands_run(sandbox: Sandbox) -> None:
    result = sandbox.commands.run("echo hello; echo oops >&2; exit 0")
    assert (result.stdout, result.stderr, result.exit_code) == ("hello\n", "oops\n", 0)
    assert sandbox.is_running()


def test_command_output_streams_before_the_command_ends(sandbox: Sandbox) -> None:
    # The command prints, then waits for a file that the test creates only after it has seen
    # that output through the proxy. A proxy that held the Connect stream back would deadlock
    # until the command's deadline killed it.
    flag = f"/tmp/proxy-flag-{uuid.uuid4().hex}"
    first = threading.Event()
    results: list[CommandResult] = []
    handle = sandbox.commands.run(
        f"echo first; while [ ! -e {flag} ]; do sleep 0.02; done; echo second",
        background=True,
        timeout=WAIT,
    )
    waiter = threading.Thread(
        target=lambda: results.append(
            handle.wait(on_stdout=lambda line: first.set() if "first" in line else None)
        ),
        daemon=True,
    )
    waiter.start()
    assert first.wait(WAIT)
    sandbox.files.write(flag, "")
    waiter.join(WAIT)
    assert results[0].stdout == "first\nsecond\n"


def test_pty(sandbox: Sandbox) -> None:
    handle = sandbox.pty.create(PtySize(rows=24, cols=80))
    sandbox.pty.resize(handle.pid, PtySize(rows=33, cols=111))
    sandbox.pty.send_stdin(handle.pid, b"echo $((6*7)); stty size; exit\n")
    out: list[bytes] = []
    assert handle.wait(on_pty=out.append).exit_code == 0
    text = b"".join(out).decode(errors="replace")
    assert "42" in text
    assert "33 111" in text


def test_large_file_write_and_read(sandbox: Sandbox) -> None:
    data = os.urandom(24 * 1024 * 1024 + 17)
    path = f"/tmp/proxy-large-{uuid.uuid4().hex}"
    sandbox.files.write(path, data)
    try:
        assert hashlib.sha256(sandbox.files.read(path, format="bytes")).digest() == (
            hashlib.sha256(data).digest()
        )
        digest = hashlib.sha256()
        for chunk in sandbox.files.read(path, format="stream"):
            digest.update(chunk)
        assert digest.digest() == hashlib.sha256(data).digest()
    finally:
        sandbox.files.remove(path)


async def test_streamed_watch(proxy_url: str, envd_port: int) -> None:
    sandbox = async_sdk_sandbox(proxy_url, ENVD_SANDBOX)
    workdir = f"/tmp/proxy-watch-{uuid.uuid4().hex}"
    await sandbox.files.make_dir(workdir)
    seen: list[tuple[FilesystemEventType, str]] = []
    written = asyncio.Event()

    def on_event(event: FilesystemEvent) -> None:
        seen.append((event.type, event.name))
        if event.type == FilesystemEventType.WRITE:
            written.set()

    handle = await sandbox.files.watch_dir(workdir, on_event)
    try:
        await sandbox.files.write(f"{workdir}/w.txt", "watched")
        await asyncio.wait_for(written.wait(), WAIT)
    finally:
        await handle.stop()  # type: ignore[no-untyped-call]  # the SDK leaves it untyped
        await sandbox.files.remove(workdir)
    assert (FilesystemEventType.CREATE, "w.txt") in seen


async def test_concurrent_commands(proxy_url: str, envd_port: int) -> None:
    # Many streams at once over the proxy's pool: each gets its own output, none is lost.
    sandbox = async_sdk_sandbox(proxy_url, ENVD_SANDBOX)
    results = await asyncio.gather(*(sandbox.commands.run(f"echo run-{i}") for i in range(60)))
    assert [r.stdout for r in results] == [f"run-{i}\n" for i in range(60)]


def test_unknown_sandbox_is_not_running(proxy_url: str) -> None:
    gone = sdk_sandbox(proxy_url, "nosuchsandbox0000000")
    assert not gone.is_running()
    with pytest.raises(SandboxNotRunningException):
        gone.commands.run("true")
    with pytest.raises(SandboxNotRunningException):
        gone.files.read("/etc/hostname")


def test_paused_sandbox_is_not_running(proxy_url: str, resolver: DictResolver) -> None:
    resolver.sandboxes["pausedsandbox0000001"] = FakeSandbox({}, paused=True)
    try:
        paused = sdk_sandbox(proxy_url, "pausedsandbox0000001")
        assert not paused.is_running()
        with pytest.raises(SandboxNotRunningException):
            paused.commands.run("true")
    finally:
        del resolver.sandboxes["pausedsandbox0000001"]


def test_envd_port_closed_is_unreachable(proxy_url: str, resolver: DictResolver) -> None:
    resolver.sandboxes["noenvdsandbox0000001"] = FakeSandbox({})
    try:
        broken = sdk_sandbox(proxy_url, "noenvdsandbox0000001")
        with pytest.raises(SandboxUnreachableException, match="port is not open"):
            broken.commands.run("true")
        with pytest.raises(SandboxUnreachableException, match="port is not open"):
            broken.files.read("/etc/hostname")
    finally:
        del resolver.sandboxes["noenvdsandbox0000001"]


def test_traffic_token_does_not_apply_to_envd(
    proxy_url: str, resolver: DictResolver, envd_port: int
) -> None:
    # The SDK never sends the traffic token to envd, which checks its own access token.
    resolver.sandboxes["securedsandbox000001"] = FakeSandbox(
        {ENVD: envd_port}, traffic_access_token="s3cret"
    )
    try:
        secured = sdk_sandbox(proxy_url, "securedsandbox000001")
        assert secured.commands.run("echo ok").stdout == "ok\n"
    finally:
        del resolver.sandboxes["securedsandbox000001"]


def test_envd_access_token_and_signed_urls_pass_through(
    proxy_url: str, resolver: DictResolver
) -> None:
    # A second envd with an access token, as a secured sandbox's: the proxy passes
    # X-Access-Token and signed /files query strings through untouched.
    token = "envd-token-for-proxy-test"
    port = free_port()
    with envd_in_throwaway_root(port, f"--access-token={token}"):
        resolver.sandboxes["tokensandbox00000001"] = FakeSandbox({ENVD: port})
        try:
            secured = sdk_sandbox(proxy_url, "tokensandbox00000001", token)
            assert secured.commands.run("echo secured").stdout == "secured\n"
            secured.files.write("/tmp/signed.txt", "signed content")
            # The signed URL names no sandbox (E2B_SANDBOX_URL is the proxy); host routing
            # addresses it, as with a real domain.
            url = secured.download_url("/tmp/signed.txt", use_signature_expiration=600)
            host = {"Host": f"{ENVD}-tokensandbox00000001.{DOMAIN}"}
            assert httpx.get(url, headers=host).text == "signed content"
            assert (
                httpx.get(url.replace("signature=v1_", "signature=v1_x"), headers=host).json()[
                    "message"
                ]
                == "invalid signature"
            )
            with pytest.raises(AuthenticationException):
                sdk_sandbox(proxy_url, "tokensandbox00000001").commands.run("true")
        finally:
            del resolver.sandboxes["tokensandbox00000001"]
