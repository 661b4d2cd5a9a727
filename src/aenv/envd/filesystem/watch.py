"""Directory watches over inotify: the events behind `WatchDir` and `CreateWatcher`.

Event types follow fsnotify's mapping used by infra's envd: create/moved-to -> CREATE,
modify -> WRITE, delete -> REMOVE, moved-from -> RENAME, attrib -> CHMOD. With `recursive`,
directories created later are watched as they appear.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from asyncinotify import Inotify, Mask

from aenv.envd.filesystem.entry import entry_info
from aenv.envd.proto.filesystem import filesystem_pb as pb

_WATCH_MASK = (
    Mask.CREATE
    | Mask.MODIFY
    | Mask.DELETE
    | Mask.DELETE_SELF
    | Mask.MOVED_FROM
    | Mask.MOVED_TO
    | Mask.MOVE_SELF
    | Mask.ATTRIB
    | Mask.ONLYDIR
)

_TYPES = (
    (Mask.CREATE | Mask.MOVED_TO, pb.EventType.CREATE),
    (Mask.MODIFY, pb.EventType.WRITE),
    (Mask.DELETE | Mask.DELETE_SELF, pb.EventType.REMOVE),
    (Mask.MOVED_FROM | Mask.MOVE_SELF, pb.EventType.RENAME),
    (Mask.ATTRIB, pb.EventType.CHMOD),
)

# Events that describe an entry that still exists, so `include_entry` can stat it.
_HAS_ENTRY = frozenset({pb.EventType.CREATE, pb.EventType.WRITE, pb.EventType.CHMOD})


@dataclass(frozen=True, slots=True)
class WatchOptions:
    path: str
    recursive: bool
    include_entry: bool


class DirWatch:
    """One inotify instance watching a directory (and, if recursive, its subtree)."""

    def __init__(self, options: WatchOptions) -> None:
        self.options = options
        self._inotify = Inotify()
        try:
            self._add(options.path)
        except BaseException:
            self._inotify.close()
            raise

    def _add(self, directory: str) -> None:
        self._inotify.add_watch(directory, _WATCH_MASK)
        if self.options.recursive:
            for root, dirs, _files in os.walk(directory):
                for name in dirs:
                    with contextlib.suppress(OSError):
                        self._inotify.add_watch(os.path.join(root, name), _WATCH_MASK)

    def close(self) -> None:
        self._inotify.close()

    async def events(self) -> AsyncIterator[pb.FilesystemEvent]:
        async for raw in self._inotify:
            if raw.path is None or Mask.IGNORED in raw.mask:
                continue
            full = str(raw.path)
            new_dir = Mask.ISDIR in raw.mask and raw.mask & (Mask.CREATE | Mask.MOVED_TO)
            if new_dir and self.options.recursive:
                with contextlib.suppress(OSError):
                    self._add(full)
            if (
                raw.watch is not None
                and str(raw.watch.path) == full
                and raw.mask & (Mask.DELETE_SELF | Mask.MOVE_SELF)
                and full != self.options.path
            ):
                continue  # a subdirectory's own removal is already reported by its parent
            for mask, kind in _TYPES:
                if raw.mask & mask:
                    yield self._event(full, kind)
                    break

    def _event(self, full: str, kind: pb.EventType) -> pb.FilesystemEvent:
        name = os.path.relpath(full, self.options.path)
        event = pb.FilesystemEvent(name=name, type=kind)
        if self.options.include_entry and kind in _HAS_ENTRY:
            with contextlib.suppress(OSError):
                event.entry = entry_info(full)
        return event


class PolledWatcher:
    """A `CreateWatcher` watch: events accumulate until `GetWatcherEvents` drains them."""

    def __init__(self, watch: DirWatch, max_pending: int) -> None:
        self._watch = watch
        # Oldest events are dropped past the cap so an abandoned watcher cannot grow unbounded.
        self._pending: deque[pb.FilesystemEvent] = deque(maxlen=max_pending)
        self._task = asyncio.get_running_loop().create_task(self._collect())

    async def _collect(self) -> None:
        async for event in self._watch.events():
            self._pending.append(event)

    def drain(self) -> list[pb.FilesystemEvent]:
        events = list(self._pending)
        self._pending.clear()
        return events

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._watch.close()
