"""The `filesystem.Filesystem` Connect service: stat, list, make, move, remove and watch paths.

Operations run as root (like infra's envd) and hand what they create to the calling user.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from aenv.envd.filesystem.entry import entry_info
from aenv.envd.filesystem.paths import ensure_dirs, is_network_mount
from aenv.envd.filesystem.watch import DirWatch, WatchOptions, limit_reached, sync_watches
from aenv.envd.proto.filesystem import filesystem_pb as pb
from aenv.envd.rpc import caller, keepalive_seconds, os_error
from aenv.envd.settings import Settings
from aenv.envd.users import User, resolve_path

# A polled watcher nobody asked for events for this long is closed (its client is gone).
WATCHER_IDLE_SECONDS = 600.0


def _list(root: str, display_root: str, depth: int) -> list[pb.EntryInfo]:
    entries: list[pb.EntryInfo] = []

    def walk(directory: str, display: str, level: int) -> None:
        try:
            with os.scandir(directory) as it:
                children = sorted(it, key=lambda e: e.name)
        except OSError:
            if level == 1:
                raise
            return  # an unreadable subdirectory does not fail the listing
        for child in children:
            shown = os.path.join(display, child.name)
            try:
                entries.append(entry_info(child.path, shown))
            except FileNotFoundError:
                continue  # removed while listing
            if level < depth and child.is_dir(follow_symlinks=False):
                walk(child.path, shown, level + 1)

    walk(root, display_root, 1)
    return entries


class FilesystemService:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._watchers: dict[str, tuple[DirWatch, asyncio.TimerHandle]] = {}

    def _resolve(self, path: str, user: User) -> str:
        try:
            return resolve_path(path, user, self._settings.default_workdir)
        except ValueError as e:
            raise ConnectError(Code.INVALID_ARGUMENT, str(e)) from e

    def _target(self, path: str, ctx: RequestContext[Any, Any]) -> tuple[str, User]:
        user = caller(ctx, self._settings)
        return self._resolve(path, user), user

    async def stat(
        self, request: pb.StatRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.StatResponse:
        path, _ = self._target(request.path, ctx)
        try:
            return pb.StatResponse(entry=entry_info(path))
        except FileNotFoundError as e:
            raise ConnectError(Code.NOT_FOUND, f"file not found: '{path}'") from e
        except OSError as e:
            os_error(e, "error getting file info")

    async def make_dir(
        self, request: pb.MakeDirRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.MakeDirResponse:
        path, user = self._target(request.path, ctx)
        if os.path.isdir(path):
            raise ConnectError(Code.ALREADY_EXISTS, f"directory already exists: {path}")
        if os.path.lexists(path):
            raise ConnectError(
                Code.INVALID_ARGUMENT, f"path already exists but it is not a directory: {path}"
            )
        try:
            ensure_dirs(path, user)
            return pb.MakeDirResponse(entry=entry_info(path))
        except OSError as e:
            os_error(e, "error creating directory")

    async def move(
        self, request: pb.MoveRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.MoveResponse:
        user = caller(ctx, self._settings)
        source = self._resolve(request.source, user)
        destination = self._resolve(request.destination, user)
        if not os.path.lexists(source):
            raise ConnectError(Code.NOT_FOUND, f"source file not found: '{source}'")
        try:
            ensure_dirs(os.path.dirname(destination), user)
            await asyncio.to_thread(os.rename, source, destination)
            sync_watches()  # a recursive watch picks up a moved-in directory before any write
            return pb.MoveResponse(entry=entry_info(destination))
        except OSError as e:
            os_error(e, "error renaming")

    async def list_dir(
        self, request: pb.ListDirRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.ListDirResponse:
        path, _ = self._target(request.path, ctx)
        depth = request.depth or 1
        resolved = os.path.realpath(path)
        if not os.path.exists(resolved):
            raise ConnectError(Code.NOT_FOUND, f"directory not found: '{path}'")
        if not os.path.isdir(resolved):
            raise ConnectError(Code.INVALID_ARGUMENT, f"path is not a directory: {path}")
        try:
            entries = await asyncio.to_thread(_list, resolved, path, depth)
        except OSError as e:
            os_error(e, "error reading directory")
        return pb.ListDirResponse(entries=entries)

    async def remove(
        self, request: pb.RemoveRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.RemoveResponse:
        path, _ = self._target(request.path, ctx)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                await asyncio.to_thread(shutil.rmtree, path)
            else:
                os.remove(path)
        except FileNotFoundError:
            pass  # removing what is not there succeeds, as os.RemoveAll does
        except OSError as e:
            os_error(e, "error removing file or directory")
        return pb.RemoveResponse()

    async def _open_watch(
        self, request: pb.WatchDirRequest | pb.CreateWatcherRequest, ctx: RequestContext[Any, Any]
    ) -> DirWatch:
        path, _ = self._target(request.path, ctx)
        if not os.path.exists(path):
            raise ConnectError(Code.NOT_FOUND, f"path {path} not found")
        if not os.path.isdir(path):
            raise ConnectError(Code.INVALID_ARGUMENT, f"path {path} not a directory")
        if not request.allow_network_mounts and is_network_mount(path):
            raise ConnectError(
                Code.FAILED_PRECONDITION, f"cannot watch path on a network mount: {path}"
            )
        options = WatchOptions(os.path.realpath(path), request.recursive, request.include_entry)
        try:
            return await DirWatch.open(options)
        except OSError as e:
            if limit_reached(e):
                raise ConnectError(
                    Code.RESOURCE_EXHAUSTED,
                    f"cannot watch {path}: the sandbox has no inotify watch left "
                    "(fs.inotify.max_user_watches and max_user_instances; close other "
                    f"watches first): {e.strerror}",
                ) from e
            os_error(e, "error creating watcher")

    async def watch_dir(
        self, request: pb.WatchDirRequest, ctx: RequestContext[Any, Any], /
    ) -> AsyncIterator[pb.WatchDirResponse]:
        watch = await self._open_watch(request, ctx)
        keepalive = keepalive_seconds(ctx)
        loop = asyncio.get_running_loop()
        remaining = ctx.timeout_ms
        deadline = None if remaining is None else loop.time() + max(remaining, 0) / 1000
        try:
            yield pb.WatchDirResponse(event=Oneof("start", pb.WatchDirResponse.StartEvent()))
            while True:
                wait, until_deadline = keepalive, False
                if deadline is not None and deadline - loop.time() <= keepalive:
                    wait, until_deadline = deadline - loop.time(), True
                try:
                    if wait <= 0:
                        raise TimeoutError
                    async with asyncio.timeout(wait):
                        event = await watch.next()
                except TimeoutError:
                    # (Loop timers may fire a little early: which limit was waited for decides.)
                    if until_deadline:
                        # As connect-go ends a stream whose context expired.
                        raise ConnectError(
                            Code.DEADLINE_EXCEEDED, "context deadline exceeded"
                        ) from None
                    yield pb.WatchDirResponse(
                        event=Oneof("keepalive", pb.WatchDirResponse.KeepAlive())
                    )
                    continue
                if event is None:
                    return
                yield pb.WatchDirResponse(event=Oneof("filesystem", event))
        finally:
            watch.close()

    async def create_watcher(
        self, request: pb.CreateWatcherRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.CreateWatcherResponse:
        watcher = await self._open_watch(request, ctx)
        watcher_id = uuid.uuid4().hex
        self._watchers[watcher_id] = (watcher, self._idle_timer(watcher_id))
        return pb.CreateWatcherResponse(watcher_id=watcher_id)

    def _idle_timer(self, watcher_id: str) -> asyncio.TimerHandle:
        loop = asyncio.get_running_loop()
        return loop.call_later(
            WATCHER_IDLE_SECONDS, lambda: loop.create_task(self._close_watcher(watcher_id))
        )

    async def _close_watcher(self, watcher_id: str) -> bool:
        entry = self._watchers.pop(watcher_id, None)
        if entry is None:
            return False
        watcher, timer = entry
        timer.cancel()
        watcher.close()
        return True

    async def get_watcher_events(
        self, request: pb.GetWatcherEventsRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.GetWatcherEventsResponse:
        entry = self._watchers.get(request.watcher_id)
        if entry is None:
            raise ConnectError(Code.NOT_FOUND, f"watcher with id {request.watcher_id} not found")
        watcher, timer = entry
        timer.cancel()
        self._watchers[request.watcher_id] = (watcher, self._idle_timer(request.watcher_id))
        return pb.GetWatcherEventsResponse(events=watcher.drain())

    async def remove_watcher(
        self, request: pb.RemoveWatcherRequest, ctx: RequestContext[Any, Any], /
    ) -> pb.RemoveWatcherResponse:
        if not await self._close_watcher(request.watcher_id):
            raise ConnectError(Code.NOT_FOUND, f"watcher with id {request.watcher_id} not found")
        return pb.RemoveWatcherResponse()

    async def close(self) -> None:
        for watcher_id in list(self._watchers):
            await self._close_watcher(watcher_id)
