"""Fixtures: our code interpreter server as a local process, driven by the unmodified
`e2b-code-interpreter` SDK in debug mode with `sandbox_url` pointing at it.

The server shuts its kernels down when it stops; a kernel whose server died exits by itself
(ipykernel polls its parent)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from e2b_code_interpreter import Sandbox

from tests.support.kernelspecs import kernelspecs
from tests.support.ports import free_port

# Six kernels start at once with the template's default contexts, on a loaded host.
_START_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def server_cwd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ci-home")


@contextmanager
def running_server(
    cwd: Path,
    prefix: Sequence[str] = (),
    envd_url: str = "",
    default_contexts: str = "",
    stdout: int | None = None,
) -> Iterator[tuple[str, int]]:
    """The server's URL and pid, with the Python, Bash, JavaScript, TypeScript and R kernels;
    `prefix` runs it under another command (`unshare`, say). It asks the envd at `envd_url`
    for the sandbox's env vars; none by default (the envd of the envd tests may be on envd's
    port, with env vars of theirs). `default_contexts`: the server's `--default-contexts`;
    `stdout`: its stdout (a file descriptor), else this process's."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [*prefix, sys.executable, "-m", "aenv.code_interpreter"]
    args = ["--host", "127.0.0.1", "--port", str(port), "--cwd", str(cwd)]
    args += ["--envd-url", envd_url]
    args += ["--default-contexts", default_contexts] if default_contexts else []
    env = {**os.environ, "JUPYTER_PATH": str(kernelspecs(cwd / ".jupyter"))}
    process = subprocess.Popen([*command, *args], env=env, stdout=stdout)
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            assert process.poll() is None, "the server exited"
            try:
                if httpx.get(f"{url}/health").is_success:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        yield url, process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def unread_pipe() -> Iterator[int]:
    """The write end of a pipe whose reader is gone, as a server's stdout may be in a sandbox:
    the template's start command's pipe to envd."""
    read, write = os.pipe()
    os.close(read)
    try:
        yield write
    finally:
        os.close(write)


@pytest.fixture(scope="module")
def server_url(server_cwd: Path) -> Iterator[str]:
    with running_server(server_cwd) as (url, _):
        yield url


@pytest.fixture(scope="module")
def sandbox(server_url: str) -> Sandbox:
    return Sandbox.create(debug=True, sandbox_url=server_url)
