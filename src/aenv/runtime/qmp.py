"""A QMP connection to one QEMU process, on top of the `qemu.qmp` library.

We listen on the unix socket *before* spawning QEMU and let QEMU connect to us (`-qmp unix:PATH`
without `server`), so there is no polling for the socket to appear; every wait also watches the
process, so a QEMU that dies early fails the wait at once with its exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from qemu.qmp import ExecuteError, QMPClient, QMPError

POLL_S = 0.002
# The library logs every message at DEBUG and connection noise at INFO; that is too chatty here.
logging.getLogger("qemu.qmp").setLevel(logging.WARNING)


class MonitorError(RuntimeError):
    """A QMP command failed or QEMU went away."""


class Monitor:
    def __init__(self, path: Path, name: str) -> None:
        self.path = path
        self._client = QMPClient(name)

    async def listen(self) -> None:
        await self._client.start_server(str(self.path))

    async def accept(self, proc: asyncio.subprocess.Process, limit_s: float) -> None:
        await self._race(self._client.accept(), proc, limit_s, "QMP connection")

    async def execute(self, command: str, **arguments: Any) -> Any:
        try:
            return await self._client.execute(command, arguments or None)
        except ExecuteError as exc:
            raise MonitorError(f"{command}: {exc.error.error.desc}") from exc
        except QMPError as exc:
            raise MonitorError(f"{command}: {exc}") from exc

    async def pass_file(self, name: str, path: Path, flags: int) -> None:
        """Open `path` and hand the open file to QEMU as fd `name` (for `fd:` migration URIs:
        QEMU then reads or writes the file itself, with no helper process or pipe between)."""
        fd = os.open(path, flags | os.O_CLOEXEC, 0o600)  # guest state: private
        try:
            await self.pass_fd(name, fd)
        finally:
            os.close(fd)

    async def pass_fd(self, name: str, fd: int) -> None:
        """Hand QEMU a duplicate of open file `fd` as fd `name`; `fd` stays ours to close."""
        self._client.send_fd_scm(fd)
        await self.execute("getfd", fdname=name)

    async def wait_migration(self, proc: asyncio.subprocess.Process, limit_s: float) -> None:
        """Outgoing migration: until `query-migrate` reports completed."""

        async def poll() -> None:
            while True:
                info = await self.execute("query-migrate")
                status = info.get("status")
                if status == "completed":
                    return
                if status in ("failed", "cancelled"):
                    raise MonitorError(f"migration {status}: {info.get('error-desc', '')}")
                await asyncio.sleep(POLL_S)

        await self._race(poll(), proc, limit_s, "outgoing migration")

    async def wait_incoming(self, proc: asyncio.subprocess.Process, limit_s: float) -> None:
        """Incoming migration: until the VM has left the `inmigrate` run state."""

        async def poll() -> None:
            while True:
                status = (await self.execute("query-status"))["status"]
                if status != "inmigrate":
                    if status not in ("paused", "postmigrate", "running", "prelaunch"):
                        raise MonitorError(f"incoming migration ended in state {status}")
                    return
                await asyncio.sleep(POLL_S)

        await self._race(poll(), proc, limit_s, "incoming migration")

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._client.disconnect()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    @staticmethod
    async def _race(work: Any, proc: asyncio.subprocess.Process, limit_s: float, what: str) -> None:
        task = asyncio.ensure_future(work)
        died = asyncio.ensure_future(proc.wait())
        try:
            done, _ = await asyncio.wait(
                {task, died}, timeout=limit_s, return_when=asyncio.FIRST_COMPLETED
            )
            if task in done:
                task.result()
                return
            if died in done:
                raise MonitorError(f"QEMU exited with status {proc.returncode} during {what}")
            raise MonitorError(f"timed out after {limit_s:.0f}s waiting for {what}")
        finally:
            for t in (task, died):
                if not t.done():
                    t.cancel()
                    with contextlib.suppress(BaseException):
                        await t
