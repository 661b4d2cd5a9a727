"""Stopping a server the tests started in a process group of its own (`start_new_session`)."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_group(proc: subprocess.Popen[bytes] | None, grace_s: float) -> None:
    """SIGTERM the group (a server's graceful stop), SIGKILL it after `grace_s`; a process
    that already exited is left alone."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
