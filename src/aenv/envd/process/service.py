"""The `process.Process` Connect service: start, attach to, feed, signal and list processes."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from aenv.envd.process.handle import Exit, Output, ProcessHandle, SpawnSpec, Subscription
from aenv.envd.process.table import ProcessTable
from aenv.envd.proto.process import process_pb as pb
from aenv.envd.rpc import caller, keepalive_seconds
from aenv.envd.settings import Settings
from aenv.envd.users import User, resolve_path

_SIGNALS = {pb.Signal.SIGKILL: signal.SIGKILL, pb.Signal.SIGTERM: signal.SIGTERM}


def _event(
    message: pb.ProcessEvent.StartEvent
    | pb.ProcessEvent.DataEvent
    | pb.ProcessEvent.EndEvent
    | pb.ProcessEvent.KeepAlive,
) -> pb.ProcessEvent:
    field = {
        pb.ProcessEvent.StartEvent: "start",
        pb.ProcessEvent.DataEvent: "data",
        pb.ProcessEvent.EndEvent: "end",
        pb.ProcessEvent.KeepAlive: "keepalive",
    }[type(message)]
    return pb.ProcessEvent(event=Oneof(field, message))


def _to_proto(event: Output | Exit) -> pb.ProcessEvent:
    if isinstance(event, Output):
        return _event(pb.ProcessEvent.DataEvent(output=Oneof(event.kind, event.data)))
    end = pb.ProcessEvent.EndEvent(
        exit_code=event.exit_code, exited=event.exited, status=event.status
    )
    if event.error is not None:
        end.error = event.error
    return _event(end)


def _process_env(settings: Settings, user: User, request_envs: dict[str, str]) -> dict[str, str]:
    # Precedence as in infra's envd: base < sandbox-wide (`/init`) < request.
    env = {"HOME": user.home, "USER": user.name, "LOGNAME": user.name}
    env.update(settings.process_base_env())
    env.update(request_envs)
    return env


class ProcessService:
    def __init__(self, settings: Settings, table: ProcessTable) -> None:
        self._settings = settings
        self._table = table

    def _selected(
        self, selector: pb.ProcessSelector | None, *, exited: bool = False
    ) -> ProcessHandle:
        """The selected process. Only `Connect` (`exited=True`) also finds one that has exited
        within the retention window; for input, signals and resizes it is gone (as in infra's
        envd, so `commands.kill` of a finished command returns False)."""
        match selector.selector if selector is not None else None:
            case Oneof(field="pid", value=pid):
                handle = self._table.by_pid(pid)
                missing = f"process with pid {pid} not found"
            case Oneof(field="tag", value=tag):
                handle = self._table.by_tag(tag)
                missing = f"process with tag {tag} not found"
            case _:
                raise ConnectError(Code.INVALID_ARGUMENT, "process selector is required")
        if handle is None or (handle.exit is not None and not exited):
            raise ConnectError(Code.NOT_FOUND, missing)
        return handle

    async def list(
        self, request: pb.ListRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.ListResponse:
        return pb.ListResponse(
            processes=[
                pb.ProcessInfo(
                    config=_config(h.spec), pid=h.pid, **({"tag": h.spec.tag} if h.spec.tag else {})
                )
                for h in self._table.running()
            ]
        )

    def _spawn(self, request: pb.StartRequest, ctx: RequestContext[Any, Any]) -> ProcessHandle:
        user = caller(ctx, self._settings)
        config = request.process
        if config is None or not config.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is required")
        raw_cwd = config.cwd if config.has_field("cwd") else ""
        try:
            cwd = (
                resolve_path(raw_cwd, user, self._settings.default_workdir)
                if raw_cwd or self._settings.default_workdir
                else user.home
            )
        except ValueError as e:
            raise ConnectError(Code.INVALID_ARGUMENT, str(e)) from e
        if not os.path.isdir(cwd):
            raise ConnectError(Code.INVALID_ARGUMENT, f"cwd '{cwd}' does not exist")
        pty = request.pty if request.has_field("pty") else None
        size = (
            (pty.size.cols or 80, pty.size.rows or 24)
            if pty is not None and pty.size is not None
            else (80, 24)
        )
        spec = SpawnSpec(
            cmd=config.cmd,
            args=list(config.args),
            envs=dict(config.envs),
            cwd=cwd,
            user=user,
            env=_process_env(self._settings, user, dict(config.envs)),
            # Proto default: a request without the field predates `stdin` and expects it open.
            stdin=request.stdin if request.has_field("stdin") else True,
            pty_size=size if pty is not None else None,
            tag=request.tag if request.has_field("tag") else None,
        )
        try:
            handle = ProcessHandle.spawn(spec)
        except ValueError as e:  # e.g. a NUL byte in cmd, args or envs
            raise ConnectError(
                Code.INVALID_ARGUMENT, f"error starting process '{config.cmd}': {e}"
            ) from e
        except OSError as e:
            raise ConnectError(
                # The request's fault (no such program, not executable, arguments too long), or
                # envd's (out of fds or processes).
                Code.INVALID_ARGUMENT
                if isinstance(e, FileNotFoundError | PermissionError) or e.errno == errno.E2BIG
                else Code.INTERNAL,
                f"error starting process '{config.cmd}': {e.strerror or e}",
            ) from e
        self._table.add(handle)
        return handle

    async def start(
        self, request: pb.StartRequest, ctx: RequestContext[Any, Any], /
    ) -> AsyncIterator[pb.StartResponse]:
        handle = self._spawn(request, ctx)
        deadline = _deadline(ctx)
        _kill_at_deadline(handle, deadline)
        async for event in _stream(handle, handle.subscribe(), keepalive_seconds(ctx), deadline):
            yield pb.StartResponse(event=event)

    async def connect(
        self, request: pb.ConnectRequest, ctx: RequestContext[Any, Any], /
    ) -> AsyncIterator[pb.ConnectResponse]:
        handle = self._selected(request.process, exited=True)
        sub = handle.subscribe()
        async for event in _stream(handle, sub, keepalive_seconds(ctx), _deadline(ctx)):
            yield pb.ConnectResponse(event=event)

    async def update(
        self, request: pb.UpdateRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.UpdateResponse:
        handle = self._selected(request.process)
        if request.has_field("pty") and request.pty is not None and request.pty.size is not None:
            try:
                handle.resize(request.pty.size.cols, request.pty.size.rows)
            except (ValueError, OSError) as e:
                raise ConnectError(Code.FAILED_PRECONDITION, f"cannot resize: {e}") from e
        return pb.UpdateResponse()

    async def _write(self, handle: ProcessHandle, data: pb.ProcessInput | None) -> None:
        match data.input if data is not None else None:
            case Oneof(field="stdin", value=payload) | Oneof(field="pty", value=payload):
                try:
                    await handle.write_input(payload)
                except OSError as e:
                    raise ConnectError(Code.FAILED_PRECONDITION, f"cannot write input: {e}") from e
            case _:
                raise ConnectError(Code.INVALID_ARGUMENT, "input is required")

    async def send_input(
        self, request: pb.SendInputRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.SendInputResponse:
        await self._write(self._selected(request.process), request.input)
        return pb.SendInputResponse()

    async def stream_input(
        self, request: AsyncIterator[pb.StreamInputRequest], ctx: RequestContext[Any, Any], /
    ) -> pb.StreamInputResponse:
        handle: ProcessHandle | None = None
        async for message in request:
            match message.event:
                case Oneof(field="start", value=start):
                    handle = self._selected(start.process)
                case Oneof(field="data", value=data):
                    if handle is None:
                        raise ConnectError(
                            Code.FAILED_PRECONDITION, "input stream must start with a start event"
                        )
                    await self._write(handle, data.input)
                case _:
                    pass  # keepalive
        return pb.StreamInputResponse()

    async def send_signal(
        self, request: pb.SendSignalRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.SendSignalResponse:
        handle = self._selected(request.process)
        signum = _SIGNALS.get(request.signal)
        if signum is None:
            raise ConnectError(Code.UNIMPLEMENTED, f"invalid signal: {request.signal}")
        handle.signal(signum)
        return pb.SendSignalResponse()

    async def close_stdin(
        self, request: pb.CloseStdinRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.CloseStdinResponse:
        handle = self._selected(request.process)
        try:
            handle.close_stdin()
        except ValueError as e:
            raise ConnectError(Code.FAILED_PRECONDITION, str(e)) from e
        return pb.CloseStdinResponse()


def _config(spec: SpawnSpec) -> pb.ProcessConfig:
    config = pb.ProcessConfig(cmd=spec.cmd, args=spec.args, envs=spec.envs)
    config.cwd = spec.cwd
    return config


def _deadline(ctx: RequestContext[Any, Any]) -> float | None:
    """The loop time at which the request's `Connect-Timeout-Ms` expires (None: no timeout)."""
    remaining = ctx.timeout_ms
    if remaining is None:
        return None
    return asyncio.get_running_loop().time() + max(remaining, 0) / 1000


def _kill_at_deadline(handle: ProcessHandle, deadline: float | None) -> None:
    """`Connect-Timeout-Ms` on Start bounds the process's life (even after the client leaves), as
    in infra's envd; `timeout=0` in the SDK sends no header and means unbounded."""
    if deadline is not None:
        asyncio.get_running_loop().call_at(deadline, handle.signal, signal.SIGKILL)


# Loop timers (the deadline kill) may fire this much before their time.
DEADLINE_SLACK = 0.01


def _deadline_exceeded() -> ConnectError:
    # What connect-go sends when the handler's context expires; the SDKs raise TimeoutException.
    return ConnectError(Code.DEADLINE_EXCEEDED, "context deadline exceeded")


async def _stream(
    handle: ProcessHandle, sub: Subscription, keepalive: float, deadline: float | None
) -> AsyncIterator[pb.ProcessEvent]:
    """start, then data and keepalives, then end; leaving early never touches the process.
    Past the request's deadline the stream ends with DEADLINE_EXCEEDED instead of an end event
    (the process may already have been killed for it; that exit is not reported here)."""
    loop = asyncio.get_running_loop()
    try:
        yield _event(pb.ProcessEvent.StartEvent(pid=handle.pid))
        while True:
            wait, until_deadline = keepalive, False
            if deadline is not None and deadline - loop.time() <= keepalive:
                wait, until_deadline = deadline - loop.time(), True
                if wait <= 0:
                    raise _deadline_exceeded()
            try:
                async with asyncio.timeout(wait):
                    event = await sub.next()
            except TimeoutError:
                # (Loop timers may fire a little early: which limit was waited for decides.)
                if until_deadline:
                    raise _deadline_exceeded() from None
                yield _event(pb.ProcessEvent.KeepAlive())
                continue
            if (
                isinstance(event, Exit)
                and deadline is not None
                and loop.time() >= deadline - DEADLINE_SLACK
            ):
                raise _deadline_exceeded()  # killed for the deadline (or ended right at it)
            yield _to_proto(event)
            if isinstance(event, Exit):
                return
    finally:
        with contextlib.suppress(Exception):
            sub.close()
