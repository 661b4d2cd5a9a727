"""files.watch_dir: polled watchers (sync SDK), streamed WatchDir (async SDK), raw WatchDir
framing (start, keepalive, deadline), and watches released when their client leaves."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from e2b import (
    AsyncSandbox,
    FilesystemEvent,
    FilesystemEventType,
    FileType,
    NotFoundException,
    Sandbox,
    SandboxException,
)

from tests.envd.helpers import STREAM_HEADERS, envelope
from tests.support.wait import eventually_sync

CREATE, WRITE, CHMOD = (
    FilesystemEventType.CREATE,
    FilesystemEventType.WRITE,
    FilesystemEventType.CHMOD,
)


def _kinds(events: list[FilesystemEvent]) -> list[tuple[FilesystemEventType, str]]:
    return [(e.type, e.name) for e in events]


def test_new_file_gives_create_chmod_write(sandbox: Sandbox, workdir: str) -> None:
    handle = sandbox.files.watch_dir(workdir)
    try:
        sandbox.files.write(f"{workdir}/w.txt", "watched")
        # No waiting: the events are there as soon as the write has returned.
        assert _kinds(handle.get_new_events()) == [
            (CREATE, "w.txt"),
            (CHMOD, "w.txt"),
            (WRITE, "w.txt"),
        ]
        assert handle.get_new_events() == []
        sandbox.files.write(f"{workdir}/w.txt", "changed")
        assert (WRITE, "w.txt") in _kinds(handle.get_new_events())
    finally:
        handle.stop()


def test_include_entry(sandbox: Sandbox, workdir: str) -> None:
    handle = sandbox.files.watch_dir(workdir, include_entry=True)
    try:
        sandbox.files.write(f"{workdir}/e.txt", "entry")
        events = handle.get_new_events()
        write = next(e for e in events if e.type == WRITE)
        assert write.entry is not None
        assert (write.entry.name, write.entry.path, write.entry.type) == (
            "e.txt",
            f"{workdir}/e.txt",
            FileType.FILE,
        )
        sandbox.files.remove(f"{workdir}/e.txt")
        removed = [e for e in handle.get_new_events() if e.type == FilesystemEventType.REMOVE]
        assert [(e.name, e.entry) for e in removed] == [("e.txt", None)]
    finally:
        handle.stop()


def test_remove_rename_chmod_events(sandbox: Sandbox, workdir: str) -> None:
    sandbox.files.write(f"{workdir}/a.txt", "a")
    handle = sandbox.files.watch_dir(workdir)
    try:
        sandbox.files.rename(f"{workdir}/a.txt", f"{workdir}/b.txt")
        sandbox.commands.run(f"chmod 600 {workdir}/b.txt")
        sandbox.files.remove(f"{workdir}/b.txt")
        kinds = _kinds(handle.get_new_events())
        assert kinds == [
            (FilesystemEventType.RENAME, "a.txt"),
            (CREATE, "b.txt"),
            (CHMOD, "b.txt"),
            (FilesystemEventType.REMOVE, "b.txt"),
        ]
    finally:
        handle.stop()


def test_non_recursive_ignores_nested_changes(sandbox: Sandbox, workdir: str) -> None:
    sandbox.files.make_dir(f"{workdir}/sub")
    handle = sandbox.files.watch_dir(workdir)
    try:
        sandbox.files.write(f"{workdir}/sub/n.txt", "nested")
        sandbox.files.write(f"{workdir}/top.txt", "top")
        names = {e.name for e in handle.get_new_events()}
        assert names == {"top.txt"}
    finally:
        handle.stop()


def test_recursive_existing_subdirectory(sandbox: Sandbox, workdir: str) -> None:
    sandbox.files.make_dir(f"{workdir}/sub/deeper")
    handle = sandbox.files.watch_dir(workdir, recursive=True)
    try:
        sandbox.files.write(f"{workdir}/sub/deeper/r.txt", "r")
        assert _kinds(handle.get_new_events()) == [
            (CREATE, "sub/deeper/r.txt"),
            (CHMOD, "sub/deeper/r.txt"),
            (WRITE, "sub/deeper/r.txt"),
        ]
    finally:
        handle.stop()


def test_recursive_directory_created_after_watch(sandbox: Sandbox, workdir: str) -> None:
    handle = sandbox.files.watch_dir(workdir, recursive=True)
    try:
        sandbox.files.make_dir(f"{workdir}/later")
        sandbox.files.write(f"{workdir}/later/f.txt", "f")
        sandbox.files.write(f"{workdir}/made/by/upload.txt", "u")
        kinds = _kinds(handle.get_new_events())
        assert (CREATE, "later") in kinds
        assert (WRITE, "later/f.txt") in kinds
        assert (CREATE, "made") in kinds
        assert (WRITE, "made/by/upload.txt") in kinds
    finally:
        handle.stop()


def test_watch_errors(sandbox: Sandbox, workdir: str) -> None:
    with pytest.raises(NotFoundException):
        sandbox.files.watch_dir(f"{workdir}/missing")
    sandbox.files.write(f"{workdir}/file.txt", "f")
    with pytest.raises(SandboxException):
        sandbox.files.watch_dir(f"{workdir}/file.txt")


def test_stopped_watcher_is_gone(sandbox: Sandbox, workdir: str) -> None:
    handle = sandbox.files.watch_dir(workdir)
    handle.stop()
    with pytest.raises(SandboxException):
        handle.get_new_events()


async def test_async_watch_streams_events(async_sandbox: AsyncSandbox) -> None:
    workdir = "/home/user/watch-async"
    await async_sandbox.files.make_dir(workdir)
    seen: list[FilesystemEvent] = []
    got_write = asyncio.Event()

    def on_event(event: FilesystemEvent) -> None:
        seen.append(event)
        if event.type == WRITE:
            got_write.set()

    handle = await async_sandbox.files.watch_dir(workdir, on_event, include_entry=True)
    try:
        await async_sandbox.files.write(f"{workdir}/s.txt", "streamed")
        await asyncio.wait_for(got_write.wait(), 30)
        assert _kinds(seen) == [(CREATE, "s.txt"), (CHMOD, "s.txt"), (WRITE, "s.txt")]
        assert seen[-1].entry is not None
        assert seen[-1].entry.size == len("streamed")
    finally:
        await handle.stop()  # type: ignore[no-untyped-call]  # the SDK leaves it untyped
        await async_sandbox.files.remove(workdir)


async def test_async_recursive_watch(async_sandbox: AsyncSandbox) -> None:
    workdir = "/home/user/watch-async-rec"
    await async_sandbox.files.make_dir(f"{workdir}/a")
    seen: list[FilesystemEvent] = []
    done = asyncio.Event()

    def on_event(event: FilesystemEvent) -> None:
        seen.append(event)
        if event.type == WRITE and event.name == "a/b/c.txt":
            done.set()

    handle = await async_sandbox.files.watch_dir(workdir, on_event, recursive=True)
    try:
        await async_sandbox.files.write(f"{workdir}/a/b/c.txt", "c")
        await asyncio.wait_for(done.wait(), 30)
        assert (CREATE, "a/b") in _kinds(seen)
    finally:
        await handle.stop()  # type: ignore[no-untyped-call]  # the SDK leaves it untyped
        await async_sandbox.files.remove(workdir)


async def test_async_watch_missing_directory(async_sandbox: AsyncSandbox) -> None:
    with pytest.raises(NotFoundException):
        await async_sandbox.files.watch_dir("/home/user/no-such-dir", lambda _: None)


def _watch_stream(
    url: str, path: str, *, keepalive: int | None = None, timeout_ms: int | None = None
) -> tuple[httpx.Client, httpx.Response]:
    headers = dict(STREAM_HEADERS)
    if keepalive is not None:
        headers["Keepalive-Ping-Interval"] = str(keepalive)
    if timeout_ms is not None:
        headers["Connect-Timeout-Ms"] = str(timeout_ms)
    client = httpx.Client(base_url=url, timeout=60)
    request = client.build_request(
        "POST",
        "/filesystem.Filesystem/WatchDir",
        content=envelope({"path": path}),
        headers=headers,
    )
    return client, client.send(request, stream=True)


class _Frames:
    """Reads Connect envelopes off a streaming response one at a time."""

    def __init__(self, response: httpx.Response) -> None:
        self._chunks = response.iter_raw()
        self._buffer = b""

    def next(self) -> tuple[int, dict[str, object]]:
        while True:
            if len(self._buffer) >= 5:
                length = int.from_bytes(self._buffer[1:5], "big")
                if len(self._buffer) >= 5 + length:
                    flags = self._buffer[0]
                    payload = self._buffer[5 : 5 + length]
                    self._buffer = self._buffer[5 + length :]
                    return flags, json.loads(payload)
            self._buffer += next(self._chunks)


def test_watch_stream_start_keepalive_then_events(
    sandbox: Sandbox, envd_url: str, workdir: str
) -> None:
    client, response = _watch_stream(envd_url, workdir, keepalive=1)
    try:
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/connect+json"
        frames = _Frames(response)
        assert frames.next() == (0, {"start": {}})
        assert frames.next() == (0, {"keepalive": {}})
        assert frames.next() == (0, {"keepalive": {}})
        # Still watching after idle keepalives.
        sandbox.files.write(f"{workdir}/k.txt", "k")
        _, message = frames.next()
        while "keepalive" in message:
            _, message = frames.next()
        assert message == {"filesystem": {"name": "k.txt", "type": "EVENT_TYPE_CREATE"}}
    finally:
        response.close()
        client.close()


def test_watch_stream_ends_with_deadline_exceeded(envd_url: str, workdir: str) -> None:
    client, response = _watch_stream(envd_url, workdir, timeout_ms=300)
    try:
        frames = _Frames(response)
        assert frames.next() == (0, {"start": {}})
        assert frames.next() == (
            2,
            {"error": {"code": "deadline_exceeded", "message": "context deadline exceeded"}},
        )
    finally:
        response.close()
        client.close()


def _inotify_fds(sandbox: Sandbox) -> int:
    # envd is PID 1 of the throwaway root's PID namespace.
    out = sandbox.commands.run(
        "ls -l /proc/1/fd | grep -c inotify || true", user="root"
    ).stdout.strip()
    return int(out or 0)


def test_disconnected_watch_stream_is_released(
    sandbox: Sandbox, envd_url: str, workdir: str
) -> None:
    before = _inotify_fds(sandbox)
    client, response = _watch_stream(envd_url, workdir)
    frames = _Frames(response)
    assert frames.next() == (0, {"start": {}})
    assert _inotify_fds(sandbox) == before + 1
    response.close()
    client.close()
    eventually_sync(lambda: _inotify_fds(sandbox) == before)


def test_stopped_polled_watcher_is_released(sandbox: Sandbox, workdir: str) -> None:
    before = _inotify_fds(sandbox)
    handle = sandbox.files.watch_dir(workdir, recursive=True)
    assert _inotify_fds(sandbox) == before + 1
    handle.stop()
    assert _inotify_fds(sandbox) == before


def test_recursive_watch_of_a_big_tree(sandbox: Sandbox, workdir: str) -> None:
    sandbox.commands.run(f"cd {workdir} && mkdir -p t/{{1..40}}/{{1..50}}")
    handle = sandbox.files.watch_dir(workdir, recursive=True)
    try:
        sandbox.files.write(f"{workdir}/t/40/50/deep.txt", "deep")
        assert (WRITE, "t/40/50/deep.txt") in _kinds(handle.get_new_events())
    finally:
        handle.stop()
