"""Start our envd for tests inside a throwaway root (see throwaway_root.sh) and stop it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

HARNESS = Path(__file__).with_name("throwaway_root.sh")
PROJECT = Path(__file__).resolve().parents[2]


def python_paths() -> list[str]:
    """What a throwaway root must bind to run this project's Python."""
    paths = {
        str(PROJECT),
        sys.prefix,
        sys.base_prefix,
        str(Path(sys.executable).resolve().parent.parent),
    }
    return sorted(p for p in paths if p not in ("/", "/usr"))


@contextmanager
def envd_in_throwaway_root(
    port: int, *extra_args: str, poll_interval: float = 0.1
) -> Iterator[str]:
    """Run envd on 127.0.0.1:`port` as root of a throwaway root; yields its base URL."""
    envd = [sys.executable, "-m", "aenv.envd", "--host", "127.0.0.1", "--port", str(port)]
    with serve_in_throwaway_root(
        [*envd, *extra_args], port, binds=python_paths(), poll_interval=poll_interval
    ) as url:
        yield url


@contextmanager
def serve_in_throwaway_root(
    command: Sequence[str],
    port: int,
    *,
    binds: Sequence[str] = (),
    harness_options: Sequence[str] = (),
    poll_interval: float = 0.1,
) -> Iterator[str]:
    """Run an envd `command` listening on 127.0.0.1:`port` as root of a throwaway root (with the
    harness's `--lower`/`--ro-bind` options); yields its base URL once `/health` answers, which
    is checked every `poll_interval` seconds."""
    scratch = tempfile.mkdtemp(prefix="aenv-test-envd-")
    log = Path(scratch, "envd.log").open("wb")  # noqa: SIM115 - closed below
    cmd = [str(HARNESS), *harness_options, scratch, *binds, "--", *command]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        # One client for all probes: a new one per probe costs ~25 ms of CPU (its TLS context).
        with httpx.Client(timeout=1) as probe:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"envd exited: {Path(scratch, 'envd.log').read_text()}")
                try:
                    if probe.get(f"{url}/health").status_code == 204:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("envd did not become healthy")
                time.sleep(poll_interval)
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
