"""One spawned process: its pipes or PTY, its output fan-out to subscribers, its exit.

Output is read from non-blocking fds on the event loop and offered to every subscriber. A
subscriber holding more than `HIGH_WATER` bytes pauses the readers (the child then blocks on a full
pipe), so a slow client bounds memory instead of growing it. The process ends when the main child
exits, not when its pipes reach EOF: a command that leaves a background server running must still
return (what `bash -c "server &"` users expect, and what infra's envd does).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import signal
import struct
import subprocess
import termios
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

from aenv.envd.process.reaper import OWN_CHILDREN
from aenv.envd.users import User

CHUNK = 64 * 1024
HIGH_WATER = 4 * 1024 * 1024
LOW_WATER = 1 * 1024 * 1024
CHILD_OOM_SCORE_ADJ = 100

OutputKind = Literal["stdout", "stderr", "pty"]


@dataclass(frozen=True, slots=True)
class Output:
    kind: OutputKind
    data: bytes


@dataclass(frozen=True, slots=True)
class Exit:
    exit_code: int
    exited: bool
    status: str

    @property
    def error(self) -> str | None:
        return None if self.exited and self.exit_code == 0 else self.status


Event = Output | Exit


@dataclass(frozen=True, slots=True)
class SpawnSpec:
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str
    user: User
    env: dict[str, str]
    stdin: bool
    pty_size: tuple[int, int] | None = None  # (cols, rows)
    tag: str | None = None


def _exit_from_returncode(code: int) -> Exit:
    if code >= 0:
        return Exit(code, True, f"exit status {code}")
    # Go's ProcessState.String() wording, which the SDKs surface as-is.
    name = (signal.strsignal(-code) or f"signal {-code}").lower()
    return Exit(-1, False, f"signal: {name}")


def _set_winsize(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _acquire_controlling_tty() -> None:
    # Runs in the child after setsid(): make the PTY slave (already on fd 0) its terminal so job
    # control and Ctrl-C work in interactive shells.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Subscription:
    """A reader of one process's events from the moment it subscribed."""

    def __init__(self, handle: ProcessHandle) -> None:
        self._handle = handle
        self._events: deque[Event] = deque()
        self._ready = asyncio.Event()
        self.buffered = 0

    def push(self, event: Event) -> None:
        self._events.append(event)
        if isinstance(event, Output):
            self.buffered += len(event.data)
        self._ready.set()

    async def next(self) -> Event:
        while not self._events:
            self._ready.clear()
            await self._ready.wait()
        event = self._events.popleft()
        if isinstance(event, Output):
            self.buffered -= len(event.data)
            self._handle._on_drained()
        return event

    def close(self) -> None:
        self._handle._unsubscribe(self)

    async def __aiter__(self) -> AsyncIterator[Event]:
        while True:
            event = await self.next()
            yield event
            if isinstance(event, Exit):
                return


@dataclass(eq=False)
class ProcessHandle:
    spec: SpawnSpec
    popen: subprocess.Popen[bytes]
    stdin_fd: int | None
    output_fds: dict[int, OutputKind]
    exit: Exit | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    _subs: list[Subscription] = field(default_factory=list)
    _paused: bool = False
    _pidfd: int | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def is_pty(self) -> bool:
        return self.spec.pty_size is not None

    @classmethod
    def spawn(cls, spec: SpawnSpec) -> ProcessHandle:
        """Start the process (raises OSError if it cannot be executed)."""
        loop = asyncio.get_running_loop()
        creds = _credentials(spec.user)
        if spec.pty_size is not None:
            master, slave = os.openpty()
            try:
                _set_winsize(master, *spec.pty_size)
                popen: subprocess.Popen[bytes] = subprocess.Popen(
                    [spec.cmd, *spec.args],
                    stdin=slave,
                    stdout=slave,
                    stderr=slave,
                    cwd=spec.cwd,
                    env=spec.env,
                    start_new_session=True,
                    preexec_fn=_acquire_controlling_tty,
                    user=creds.user,
                    group=creds.group,
                    extra_groups=creds.extra_groups,
                )
            except BaseException:
                os.close(master)
                raise
            finally:
                os.close(slave)
            os.set_blocking(master, False)
            handle = cls(spec, popen, master, {master: "pty"})
        else:
            # Our own pipes (not subprocess.PIPE) so the loop, not file objects, owns the fds.
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            in_r, in_w = os.pipe() if spec.stdin else (None, None)
            child_ends = [fd for fd in (out_w, err_w, in_r) if fd is not None]
            try:
                popen = subprocess.Popen(
                    [spec.cmd, *spec.args],
                    stdin=in_r if in_r is not None else subprocess.DEVNULL,
                    stdout=out_w,
                    stderr=err_w,
                    cwd=spec.cwd,
                    env=spec.env,
                    start_new_session=True,
                    user=creds.user,
                    group=creds.group,
                    extra_groups=creds.extra_groups,
                )
            except BaseException:
                for fd in (out_r, err_r, in_w):
                    if fd is not None:
                        os.close(fd)
                raise
            finally:
                for fd in child_ends:
                    os.close(fd)
            for fd in (out_r, err_r, in_w):
                if fd is not None:
                    os.set_blocking(fd, False)
            handle = cls(spec, popen, in_w, {out_r: "stdout", err_r: "stderr"})
        OWN_CHILDREN.add(handle.pid)
        _make_oom_preferred(handle.pid)
        handle._watch(loop)
        return handle

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        for fd in self.output_fds:
            loop.add_reader(fd, self._on_readable, fd)
        self._pidfd = os.pidfd_open(self.pid)
        loop.add_reader(self._pidfd, self._on_exit)

    def subscribe(self) -> Subscription:
        sub = Subscription(self)
        if self.exit is not None:
            sub.push(self.exit)
        else:
            self._subs.append(sub)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with contextlib.suppress(ValueError):
            self._subs.remove(sub)
        self._on_drained()

    def _publish(self, event: Event) -> None:
        for sub in self._subs:
            sub.push(event)

    def _read(self, fd: int) -> bytes | None:
        """Bytes from fd, b"" at EOF, None when nothing is available right now."""
        try:
            return os.read(fd, CHUNK)
        except BlockingIOError:
            return None
        except OSError as e:
            if e.errno == errno.EIO:  # PTY master after the last slave holder closed
                return b""
            raise

    def _on_readable(self, fd: int) -> None:
        data = self._read(fd)
        if data is None:
            return
        if not data:
            self._close_output(fd)
            return
        self._publish(Output(self.output_fds[fd], data))
        if not self._paused and any(s.buffered > HIGH_WATER for s in self._subs):
            self._paused = True
            loop = asyncio.get_running_loop()
            for out_fd in self.output_fds:
                loop.remove_reader(out_fd)

    def _on_drained(self) -> None:
        if self._paused and all(s.buffered < LOW_WATER for s in self._subs):
            self._paused = False
            loop = asyncio.get_running_loop()
            for fd in self.output_fds:
                loop.add_reader(fd, self._on_readable, fd)

    def _close_output(self, fd: int) -> None:
        asyncio.get_running_loop().remove_reader(fd)
        kind = self.output_fds.pop(fd)
        if kind == "pty":
            # The master is also the input side; keep it for input until the process exits.
            self.output_fds[fd] = kind
            return
        os.close(fd)

    def _on_exit(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._pidfd is not None
        loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = None
        code = self.popen.wait()
        OWN_CHILDREN.discard(self.pid)
        # What the process wrote before exiting is in the pipe buffers: deliver it, then cut off
        # anything a lingering background child might write later.
        for fd, kind in list(self.output_fds.items()):
            loop.remove_reader(fd)
            while data := self._read(fd):
                self._publish(Output(kind, data))
            os.close(fd)
        self.output_fds.clear()
        self._close_stdin_fd()
        self.exit = _exit_from_returncode(code)
        self._publish(self.exit)
        self._subs.clear()
        self.done.set()

    def _close_stdin_fd(self) -> None:
        if self.stdin_fd is not None and not self.is_pty:
            os.close(self.stdin_fd)
        self.stdin_fd = None

    async def write_input(self, data: bytes) -> None:
        """Write to stdin (pipe mode) or the terminal (PTY mode)."""
        fd = self.stdin_fd
        if fd is None:
            raise BrokenPipeError("stdin is closed")
        loop = asyncio.get_running_loop()
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                writable = loop.create_future()
                loop.add_writer(fd, writable.set_result, None)
                try:
                    await writable
                finally:
                    loop.remove_writer(fd)
                if self.stdin_fd is None:
                    raise BrokenPipeError("stdin is closed") from None

    def close_stdin(self) -> None:
        if self.is_pty:
            raise ValueError("cannot close stdin of a PTY process; send Ctrl-D (0x04) instead")
        self._close_stdin_fd()

    def signal(self, signum: int) -> None:
        """Signal the whole process group: the shell and what it started."""
        if self.exit is not None:
            return
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass
        except PermissionError:
            os.kill(self.pid, signum)

    def resize(self, cols: int, rows: int) -> None:
        if not self.is_pty or self.stdin_fd is None:
            raise ValueError("process has no terminal")
        _set_winsize(self.stdin_fd, cols, rows)


def _make_oom_preferred(pid: int) -> None:
    # envd protects itself from the OOM killer and children inherit that; undo it for them.
    if os.geteuid() == 0:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write(str(CHILD_OOM_SCORE_ADJ))


@dataclass(frozen=True, slots=True)
class _Credentials:
    """Popen's user/group/extra_groups; all None when envd already runs as that user."""

    user: int | None = None
    group: int | None = None
    extra_groups: list[int] | None = None


def _credentials(user: User) -> _Credentials:
    if os.geteuid() != 0 or (user.uid == os.geteuid() and user.gid == os.getegid()):
        return _Credentials()
    return _Credentials(user.uid, user.gid, list(user.groups))
