"""Named network namespaces, and running blocking code inside one.

Names follow the `ip netns` convention (a bind mount under /run/netns), so `ip netns exec <name>`
and other tools see our namespaces. Namespaces are entered per thread: setns(2) and unshare(2)
with CLONE_NEWNET change only the calling thread, and sockets, tap devices, sysctl writes and child
processes all take the namespace of the thread that makes them. So `run_in` uses a fresh thread
for every call and lets it die afterwards: a pooled thread left inside a slot's namespace would
silently run unrelated work there.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

RUN_DIR = Path("/run/netns")

_CLONE_NEWNET = 0x40000000
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_SHARED = 0x100000
_MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)
_run_dir_lock = threading.Lock()
_run_dir_ready = False


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _ensure_run_dir() -> None:
    """Make /run/netns a shared mount point, as `ip netns add` does, so the bind mounts we add
    there propagate to mount namespaces created later (`ip netns exec` makes one)."""
    global _run_dir_ready
    with _run_dir_lock:
        if _run_dir_ready:
            return
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        path = bytes(RUN_DIR)
        if _libc.mount(b"none", path, None, _MS_SHARED | _MS_REC, None) != 0:
            # Not a mount point yet: make it one by binding it onto itself, then share it.
            _check(_libc.mount(path, path, b"none", _MS_BIND | _MS_REC, None), "bind /run/netns")
            _check(_libc.mount(b"none", path, None, _MS_SHARED | _MS_REC, None), "share /run/netns")
        _run_dir_ready = True


def path(name: str) -> Path:
    return RUN_DIR / name


def names() -> list[str]:
    try:
        return sorted(entry.name for entry in RUN_DIR.iterdir())
    except FileNotFoundError:
        return []


def create_and_enter(name: str) -> None:
    """Move the calling thread into a new network namespace and name it `name`."""
    _ensure_run_dir()
    target = path(name)
    with contextlib.ExitStack() as undo:
        fd = os.open(target, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0)
        os.close(fd)
        undo.callback(target.unlink)
        _check(_libc.unshare(_CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        own = f"/proc/self/task/{threading.get_native_id()}/ns/net".encode()
        _check(_libc.mount(own, bytes(target), b"none", _MS_BIND, None), f"bind netns {name}")
        undo.pop_all()


def enter(name: str) -> None:
    """Move the calling thread into the existing namespace `name`."""
    fd = os.open(path(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.setns(fd, _CLONE_NEWNET), f"setns {name}")
    finally:
        os.close(fd)


def remove(name: str) -> None:
    """Drop the name. The namespace itself goes away once no process or open fd holds it."""
    target = path(name)
    if _libc.umount2(bytes(target), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        # EINVAL: a leftover file that is no longer a mount point (e.g. after a reboot cleared
        # the mount but not a persistent /run); ENOENT: already gone.
        if err not in (errno.EINVAL, errno.ENOENT):
            raise OSError(err, f"umount netns {name}: {os.strerror(err)}")
    target.unlink(missing_ok=True)


async def run_in(netns: str | None, fn: Callable[[], T]) -> T:
    """Run blocking `fn` on a fresh thread inside `netns` (None: the namespace this process
    started in) and return its result. `fn` may itself enter or create other namespaces.
    Cancelling the caller does not stop `fn`; it runs to completion and its result is dropped."""
    done: Future[T] = Future()
    done.set_running_or_notify_cancel()  # so cancelling the caller cannot cancel `done`

    def body() -> None:
        try:
            if netns is not None:
                enter(netns)
            done.set_result(fn())
        except BaseException as error:  # not a rollback: any error must reach the awaiter
            done.set_exception(error)

    threading.Thread(target=body, name=f"netns:{netns or '-'}", daemon=True).start()
    return await asyncio.wrap_future(done)
