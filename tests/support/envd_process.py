"""Start our envd for tests inside a throwaway root (see throwaway_root.sh) and stop it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

HARNESS = Path(__file__).with_name("throwaway_root.sh")
PROJECT = Path(__file__).resolve().parents[2]


def _python_paths() -> list[str]:
    paths = {
        str(PROJECT),
        sys.prefix,
        sys.base_prefix,
        str(Path(sys.executable).resolve().parent.parent),
    }
    return sorted(p for p in paths if p not in ("/", "/usr"))


@contextmanager
def envd_in_throwaway_root(port: int, *extra_args: str) -> Iterator[str]:
    """Run envd on 127.0.0.1:`port` as root of a throwaway root; yields its base URL."""
    scratch = tempfile.mkdtemp(prefix="aenv-test-envd-")
    log = Path(scratch, "envd.log").open("wb")  # noqa: SIM115 - closed below
    cmd = [
        str(HARNESS),
        scratch,
        *_python_paths(),
        "--",
        sys.executable,
        "-m",
        "aenv.envd",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra_args,
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"envd exited: {Path(scratch, 'envd.log').read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 204:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("envd did not become healthy")
            time.sleep(0.1)
        yield url
    finally:
        # unshare --kill-child: ending it kills envd (PID 1 of its namespace) and everything
        # it started, and the namespace's mounts go with them.
        with_group = os.getpgid(proc.pid) if proc.poll() is None else None
        if with_group is not None:
            os.killpg(with_group, signal.SIGKILL)
        proc.wait()
        log.close()
        shutil.rmtree(scratch, ignore_errors=True)
