"""A guest out of inotify instances or watches: a watch request is refused with
RESOURCE_EXHAUSTED and a message naming the limit, never an internal error (500).

envd runs as root of a user namespace of its own whose inotify limits the test lowers
(`/proc/sys/user/max_inotify_*` are per user namespace), so the host's stay untouched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox
from e2b.exceptions import RateLimitException

from tests.proxy.conftest import sdk_sandbox
from tests.support.envd_process import PROJECT
from tests.support.ports import free_port


@pytest.fixture(scope="module")
def limited_envd() -> Iterator[str]:
    """envd allowed 2 inotify instances and 3 watches in all."""
    port = free_port()
    limits = (
        "echo 2 > /proc/sys/user/max_inotify_instances && "
        'echo 3 > /proc/sys/user/max_inotify_watches && exec "$@"'
    )
    envd = [sys.executable, "-m", "aenv.envd", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "sh", "-c", limits, "limits", *envd],
        cwd=PROJECT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "envd exited"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 204:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "envd did not become healthy"
                time.sleep(0.1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def sandbox(limited_envd: str) -> Sandbox:
    return sdk_sandbox(limited_envd, "limitedsandbox000001")


def test_a_recursive_watch_past_the_watch_limit(sandbox: Sandbox, tmp_path: Path) -> None:
    for name in ("a", "b", "c", "d"):
        (tmp_path / name).mkdir()
    with pytest.raises(RateLimitException, match="no inotify watch left"):
        sandbox.files.watch_dir(str(tmp_path), recursive=True, user="root")
    # The failed watch gave its watches back: a smaller one still works.
    handle = sandbox.files.watch_dir(str(tmp_path / "a"), user="root")
    handle.stop()


def test_watches_past_the_instance_limit(sandbox: Sandbox, tmp_path: Path) -> None:
    handles = [sandbox.files.watch_dir(str(tmp_path), user="root") for _ in range(2)]
    try:
        with pytest.raises(RateLimitException, match="no inotify watch left"):
            sandbox.files.watch_dir(str(tmp_path), user="root")
    finally:
        for handle in handles:
            handle.stop()
    assert sandbox.files.exists(str(tmp_path), user="root")
