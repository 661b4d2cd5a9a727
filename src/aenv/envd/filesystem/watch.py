"""Directory watches over inotify: the events behind `WatchDir` and `CreateWatcher`.

Event types follow fsnotify's mapping used by infra's envd: create/moved-to -> CREATE,
modify -> WRITE, delete -> REMOVE, moved-from -> RENAME, attrib -> CHMOD. With `recursive`,
directories created later are watched as they appear.

The kernel queues inotify events synchronously with the change that causes them, so a watch is
read ("pumped") whenever its fd is readable and also on demand: before `GetWatcherEvents`
answers, and right after envd itself creates directories (`sync_watches`). A client that writes
a file and then asks for events therefore always sees them, and a recursive watch is already
watching a directory envd just made before anything is written into it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections import deque
from dataclasses import dataclass

from asyncinotify import Event, Inotify, Mask

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

# Events a watch holds for its reader; past this the oldest are dropped, so an abandoned
# polled watcher (or a stalled stream) cannot grow without bound.
MAX_PENDING_EVENTS = 100_000

_ACTIVE: set[DirWatch] = set()
# What the kernel answers once the guest's inotify instances (EMFILE) or watches (ENOSPC) are
# all taken, or its open files (ENFILE).
_LIMIT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOSPC})


def limit_reached(e: OSError) -> bool:
    """Whether `e` says the guest has no inotify instance or watch left for a new watch."""
    return e.errno in _LIMIT_ERRNOS


def sync_watches() -> None:
    """Read every watch's queued inotify events now (call after envd itself changes the tree)."""
    for watch in list(_ACTIVE):
        watch.pump()


@dataclass(frozen=True, slots=True)
class WatchOptions:
    path: str
    recursive: bool
    include_entry: bool


class DirWatch:
    """One inotify instance watching a directory (and, if recursive, its subtree)."""

    def __init__(self, options: WatchOptions, max_pending: int = MAX_PENDING_EVENTS) -> None:
        """A watch on `options.path` only; `open` also adds the subtree of a recursive one."""
        self.options = options
        # sync_timeout=0: `sync_get` polls the fd and returns None when nothing is queued.
        self._inotify = Inotify(sync_timeout=0)
        self._pending: deque[pb.FilesystemEvent] = deque(maxlen=max_pending)
        self._ready = asyncio.Event()
        self._closed = False
        try:
            self._inotify.add_watch(options.path, _WATCH_MASK)
        except BaseException:
            self._inotify.close()
            raise
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._inotify.fd, self.pump)
        _ACTIVE.add(self)

    @classmethod
    async def open(cls, options: WatchOptions) -> DirWatch:
        """Start watching. A recursive watch walks its tree in a thread (a big tree must not
        stall envd); directories made meanwhile are caught by the events of their parents."""
        watch = cls(options)
        if options.recursive:
            try:
                await asyncio.to_thread(watch._add_subdirectories, options.path)
            except BaseException:
                watch.close()
                raise
        return watch

    def _add_subdirectories(self, directory: str) -> None:
        """Watch every directory below `directory`. One that vanished or is unreadable is
        skipped; the limit reached fails the watch (a watch missing part of its tree would
        report nothing about it)."""
        for root, dirs, _files in os.walk(directory):
            for name in dirs:
                try:
                    self._inotify.add_watch(os.path.join(root, name), _WATCH_MASK)
                except OSError as e:
                    if limit_reached(e):
                        raise

    def _add(self, directory: str) -> None:
        self._inotify.add_watch(directory, _WATCH_MASK)
        if self.options.recursive:
            self._add_subdirectories(directory)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _ACTIVE.discard(self)
        self._loop.remove_reader(self._inotify.fd)
        self._inotify.close()
        self._ready.set()

    def pump(self) -> None:
        """Move every event the kernel has queued into this watch's pending events."""
        if self._closed:
            return
        while True:
            try:
                raw = self._inotify.sync_get()
            except (BlockingIOError, InterruptedError):
                break
            if raw is None:
                break
            event = self._convert(raw)
            if event is not None:
                self._pending.append(event)
        if self._pending:
            self._ready.set()

    def _convert(self, raw: Event) -> pb.FilesystemEvent | None:
        if raw.path is None or Mask.IGNORED in raw.mask:
            return None
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
            return None  # a subdirectory's own removal is already reported by its parent
        for mask, kind in _TYPES:
            if raw.mask & mask:
                return self._event(full, kind)
        return None

    def _event(self, full: str, kind: pb.EventType) -> pb.FilesystemEvent:
        name = os.path.relpath(full, self.options.path)
        event = pb.FilesystemEvent(name=name, type=kind)
        if self.options.include_entry and kind in _HAS_ENTRY:
            with contextlib.suppress(OSError):
                event.entry = entry_info(full)
        return event

    def drain(self) -> list[pb.FilesystemEvent]:
        """Every event so far (for `GetWatcherEvents`), including those queued just now."""
        self.pump()
        events = list(self._pending)
        self._pending.clear()
        self._ready.clear()
        return events

    async def next(self) -> pb.FilesystemEvent | None:
        """The next event as it happens, None once the watch is closed (for `WatchDir`).
        Safe to cancel (e.g. by a keepalive timeout): no event is lost."""
        while not self._closed:
            self.pump()
            if self._pending:
                return self._pending.popleft()
            self._ready.clear()
            await self._ready.wait()
        return None
