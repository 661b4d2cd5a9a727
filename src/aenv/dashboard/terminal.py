"""A terminal in the page: a WebSocket between xterm.js and a shell on a sandbox's PTY, which
envd's process service runs (as an SDK's `sandbox.pty` does), reached through the node's
`EnvdClient`.

The browser sends keystrokes and pastes as binary frames and `{"type": "resize", "cols",
"rows"}` as text; it receives the PTY's output as binary frames and `{"type": "started",
"pid"}`, then `{"type": "exit", "code"}` as text. A browser that lost its connection comes back
with `?pid=` and is attached to the same shell (envd's `Connect`): a shell lives on when its
socket drops, and is killed when the page closes it (a close code of 1000 or 1001).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Protocol

import pyqwest
from connectrpc.errors import ConnectError
from protobuf import Oneof
from starlette.websockets import WebSocket, WebSocketDisconnect

from aenv.envd.proto.process import process_pb as pb
from aenv.envd.proto.process.process_connect import ProcessClient
from aenv.orchestrator.envd_client import EnvdClient, rpc_transport

# The user a shell runs as, as the SDKs' PTYs do by default.
USER = "user"
# The shell and what it is told of its terminal, as the SDKs start theirs.
SHELL = pb.ProcessConfig(
    cmd="/bin/bash",
    args=["-i", "-l"],
    envs={"TERM": "xterm-256color", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"},
)
# The page's own closes (a reload, a tab closed): the shell is not wanted any more.
_PAGE_CLOSES = (1000, 1001)


class SandboxShells(Protocol):
    """Where a sandbox's envd is: a node's orchestrator, waking the sandbox if it sleeps."""

    async def envd(self, sandbox_id: str) -> EnvdClient:
        """The client of the sandbox's envd; `LookupError` when it does not run here."""
        ...


class Terminal:
    """One browser's socket on one shell."""

    def __init__(self, socket: WebSocket, envd: EnvdClient) -> None:
        self.socket = socket
        self.envd = envd
        self._transport = rpc_transport()
        self._rpc = ProcessClient(envd.url, http_client=pyqwest.Client(self._transport))
        self._pid: int | None = None

    async def run(self, cols: int, rows: int, pid: int | None) -> None:
        """Serve the socket until the shell ends or the browser goes."""
        output = asyncio.create_task(self._follow(self._events(cols, rows, pid)))
        keys = asyncio.create_task(self._keys())
        try:
            await asyncio.wait({output, keys}, return_when=asyncio.FIRST_COMPLETED)
            closed = keys.result() if keys.done() and keys.exception() is None else None
            if closed in _PAGE_CLOSES and self._pid is not None:
                await self._kill()
        finally:
            for task in (output, keys):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect):
                    await task
            await self._rpc.close()
            await self._transport.aclose()

    def _headers(self) -> dict[str, str]:
        return self.envd.headers(USER)

    def _events(self, cols: int, rows: int, pid: int | None) -> AsyncIterator[pb.ProcessEvent]:
        if pid is not None:
            selector = pb.ProcessSelector(selector=Oneof("pid", pid))
            connected = self._rpc.connect(
                pb.ConnectRequest(process=selector), headers=self._headers()
            )
            return _events(connected)
        size = pb.PTY.Size(cols=cols, rows=rows)
        started = self._rpc.start(
            pb.StartRequest(process=SHELL, pty=pb.PTY(size=size)), headers=self._headers()
        )
        return _events(started)

    async def _follow(self, events: AsyncIterator[pb.ProcessEvent]) -> None:
        """Send the shell's output to the browser until the shell ends, then close."""
        try:
            async for event in events:
                match event.event:
                    case Oneof(field="start", value=start):
                        self._pid = start.pid
                        await self._send({"type": "started", "pid": start.pid})
                    case Oneof(
                        field="data",
                        value=pb.ProcessEvent.DataEvent(output=Oneof(field="pty", value=data)),
                    ):
                        await self.socket.send_bytes(data)
                    case Oneof(field="end", value=end):
                        self._pid = None
                        await self._send({"type": "exit", "code": end.exit_code})
            await self.socket.close()
        except ConnectError as e:
            await self._send({"type": "error", "message": e.message})
            await self.socket.close()

    async def _keys(self) -> int:
        """Pass the browser's keys and sizes to the shell; the close code when it goes."""
        while True:
            message = await self.socket.receive()
            if message["type"] == "websocket.disconnect":
                code: int = message.get("code", 1000)
                return code
            if self._pid is None:
                continue  # not started yet: what a browser sends before is dropped
            selector = pb.ProcessSelector(selector=Oneof("pid", self._pid))
            # A shell that just ended refuses: its end reaches the browser from `_follow`.
            with contextlib.suppress(ConnectError):
                if message.get("bytes"):
                    data = pb.ProcessInput(input=Oneof("pty", message["bytes"]))
                    await self._rpc.send_input(
                        pb.SendInputRequest(process=selector, input=data), headers=self._headers()
                    )
                elif message.get("text"):
                    size = _size(message["text"])
                    if size is not None:
                        pty = pb.PTY(size=pb.PTY.Size(cols=size[0], rows=size[1]))
                        await self._rpc.update(
                            pb.UpdateRequest(process=selector, pty=pty), headers=self._headers()
                        )

    async def _kill(self) -> None:
        assert self._pid is not None
        selector = pb.ProcessSelector(selector=Oneof("pid", self._pid))
        with contextlib.suppress(ConnectError):
            await self._rpc.send_signal(
                pb.SendSignalRequest(process=selector, signal=pb.Signal.SIGKILL),
                headers=self._headers(),
            )

    async def _send(self, message: dict[str, object]) -> None:
        await self.socket.send_text(json.dumps(message))


async def _events(
    stream: AsyncIterator[pb.StartResponse] | AsyncIterator[pb.ConnectResponse],
) -> AsyncIterator[pb.ProcessEvent]:
    async for response in stream:
        if response.event is not None:
            yield response.event


def _size(text: str) -> tuple[int, int] | None:
    """`(cols, rows)` of a resize message; None for anything else."""
    try:
        message = json.loads(text)
        if message.get("type") != "resize":
            return None
        cols, rows = int(message["cols"]), int(message["rows"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not (1 <= cols <= 1000 and 1 <= rows <= 1000):
        return None
    return cols, rows
