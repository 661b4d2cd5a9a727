"""One Firecracker process: spawning it (directly, in a network namespace, or through the jailer),
waiting for its API socket to answer, and killing it.

The process gets its own session so a signal aimed at the server does not reach the VMM, and its
stdout (where Firecracker writes the guest's serial console) and stderr go to files: the console
log, and the tail of stderr that explains a VMM that died early.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from aenv.runtime.firecracker.api import FirecrackerApi, FirecrackerError

READY_TIMEOUT_S = 10.0
STOP_GRACE_S = 2.0
_POLL_S = 0.002
_STDERR_TAIL = 4096


class FirecrackerExited(FirecrackerError):
    """The process exited (or never came up); `stderr` is the tail of what it printed."""

    def __init__(self, message: str, stderr: str) -> None:
        super().__init__(f"{message}; stderr: {stderr or '(empty)'}")
        self.stderr = stderr


def netns_path(netns: str) -> Path:
    """A namespace name as `ip netns` keeps it, or a path as given."""
    return Path(netns) if netns.startswith("/") else Path("/run/netns") / netns


def direct_argv(
    binary: Path,
    *,
    socket_path: Path,
    vm_id: str,
    netns: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Command line for an unjailed Firecracker started in the socket's directory; `nsenter` puts
    it into the sandbox's netns, where its tap device lives."""
    # Relative, because a unix socket address holds only 107 bytes and workdirs can be deeper.
    argv = [str(binary), "--api-sock", socket_path.name, "--id", vm_id, *extra_args]
    if netns is None:
        return argv
    return ["nsenter", f"--net={netns_path(netns)}", "--", *argv]


class FirecrackerProcess:
    """A spawned VMM with an API client bound to its socket. `stop()` is idempotent."""

    def __init__(
        self, proc: asyncio.subprocess.Process, socket_path: Path, stderr_path: Path
    ) -> None:
        self._proc = proc
        self.socket_path = socket_path
        self.stderr_path = stderr_path
        self.api = FirecrackerApi(socket_path)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @classmethod
    async def spawn(
        cls,
        argv: Sequence[str],
        *,
        cwd: Path,
        socket_path: Path,
        stdout_path: Path,
        stderr_path: Path,
        ready_timeout: float = READY_TIMEOUT_S,
    ) -> FirecrackerProcess:
        """Start `argv` and return once its API answers; on any failure the process is gone."""
        socket_path.unlink(missing_ok=True)
        with stdout_path.open("ab") as out, stderr_path.open("ab") as err:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=cwd,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        self = cls(proc, socket_path, stderr_path)
        async with contextlib.AsyncExitStack() as undo:
            undo.push_async_callback(self.stop)
            _prefer_as_oom_victim(proc.pid)
            await self._wait_ready(time.monotonic() + ready_timeout)
            undo.pop_all()
        return self

    async def _wait_ready(self, deadline: float) -> None:
        while True:
            if self._proc.returncode is not None:
                raise FirecrackerExited(
                    f"firecracker exited with {self._proc.returncode} before its API answered",
                    self.stderr_tail(),
                )
            if self.socket_path.exists():
                with contextlib.suppress(FirecrackerError):
                    await self.api.describe_instance()
                    return
            if time.monotonic() > deadline:
                raise FirecrackerExited(
                    f"firecracker API socket {self.socket_path} did not answer in time",
                    self.stderr_tail(),
                )
            # Let the event loop reap the child, so an early exit is seen on the next turn.
            await asyncio.sleep(_POLL_S)

    def stderr_tail(self) -> str:
        try:
            with self.stderr_path.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - _STDERR_TAIL))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""

    async def wait(self) -> None:
        """Until the process has exited (reaped)."""
        await self._proc.wait()

    async def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; reaps the process and closes the client.
        The guest gets no shutdown: a sandbox's state lives in snapshots, not in a clean halt."""
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self._proc.wait(), grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
                await self._proc.wait()
        await self.api.aclose()
        self.socket_path.unlink(missing_ok=True)


def _prefer_as_oom_victim(pid: int) -> None:
    """A VMM killed by the OOM killer loses one sandbox; the server dying loses all of them."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/oom_score_adj").write_text("1000")
