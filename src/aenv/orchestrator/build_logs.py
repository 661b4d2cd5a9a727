"""A template build's log, on disk as it comes: one SQLite file per build
(`$AENV_HOME/builds/<build>.log.db`), read a page at a time, removed with its build.

A log is bounded (`build_log_max_mb`): its first half is kept as it came (the steps, the first
errors), its second half holds the newest lines, and between them one entry says how many lines
and bytes were dropped. The E2B status route pages by position (the SDK adds the entries it got
to its offset), so dropping shifts the positions after the head: a reader that falls more than
half the cap behind skips what was dropped, and never reads an entry twice.

Appends are committed every `COMMIT_EVERY` entries, by `flush` (before a read) and when the log
is closed; a crash loses at most those, and the build is then reported interrupted. The writer
is the event loop's thread; readers (`page`, `around`) have connections of their own, run in
threads, and see what was committed (WAL while the build writes: readers never block it).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

LEVELS = ("debug", "info", "warn", "error")
COMMIT_EVERY = 1000
# What an entry costs besides its message (timestamp, level, step, row), counted against the cap
# so that a flood of empty lines is bounded too.
ENTRY_OVERHEAD = 32
_WARN = LEVELS.index("warn")
_SCHEMA = """
CREATE TABLE log (
    seq INTEGER PRIMARY KEY, ts REAL NOT NULL, level INTEGER NOT NULL, step TEXT,
    message TEXT NOT NULL, size INTEGER NOT NULL
);
CREATE TABLE meta (
    id INTEGER PRIMARY KEY CHECK (id = 0), next_seq INTEGER, boundary INTEGER,
    head_bytes INTEGER, tail_bytes INTEGER, dropped_lines INTEGER, dropped_bytes INTEGER
);
"""


@dataclass(frozen=True)
class LogEntry:
    timestamp: float
    level: str
    message: str
    step: str | None = None


@dataclass
class _Counts:
    next_seq: int = 0
    boundary: int | None = None  # the marker's position, once the head is full
    head_bytes: int = 0
    tail_bytes: int = 0
    dropped_lines: int = 0
    dropped_bytes: int = 0


class BuildLog:
    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.half = max(max_bytes // 2, 1)
        self._db: sqlite3.Connection | None = None  # open while the build writes
        self._counts = _Counts()
        self._pending = 0

    def _open(self) -> sqlite3.Connection:
        if self._db is None:
            if not self.path.exists():
                self._create()
            # In WAL mode nothing waits: readers never block the writer, the only one.
            db = sqlite3.connect(self.path, timeout=1.0, isolation_level="DEFERRED")
            db.execute("PRAGMA journal_mode = WAL")  # a finished log, opened again
            db.execute("PRAGMA synchronous = OFF")  # a log, not a record: no fsync per commit
            row = db.execute(
                "SELECT next_seq, boundary, head_bytes, tail_bytes, dropped_lines, dropped_bytes"
                " FROM meta"
            ).fetchone()
            if row is not None:
                self._counts = _Counts(*row)
            self._db = db
        return self._db

    def _create(self) -> None:
        """The empty log, made beside its place and renamed into it: a reader finds no file
        or a whole one, never one without its tables."""
        partial = self.path.with_name(f".{self.path.name}.{secrets.token_hex(4)}")
        try:
            with contextlib.closing(sqlite3.connect(partial)) as db:
                db.execute("PRAGMA journal_mode = WAL")
                db.executescript(_SCHEMA)
                db.commit()
            os.replace(partial, self.path)
        finally:
            for suffix in ("", "-wal", "-shm"):
                partial.with_name(partial.name + suffix).unlink(missing_ok=True)

    def append(self, entry: LogEntry) -> None:
        db = self._open()
        counts = self._counts
        size = len(entry.message.encode()) + len(entry.step or "")
        cost = size + ENTRY_OVERHEAD
        if counts.boundary is None and counts.head_bytes + cost > self.half:
            counts.boundary = counts.next_seq  # the marker's place, held from now on
            counts.next_seq += 1
        if counts.boundary is None:
            counts.head_bytes += cost
        else:
            counts.tail_bytes += cost
        db.execute(
            "INSERT INTO log VALUES (?, ?, ?, ?, ?, ?)",
            (counts.next_seq, entry.timestamp, LEVELS.index(entry.level), entry.step,
             entry.message, size),
        )  # fmt: skip
        counts.next_seq += 1
        if counts.tail_bytes > self.half:
            self._drop(db, counts)
        self._pending += 1
        if self._pending >= COMMIT_EVERY:
            self._commit()

    def extend(self, entries: Iterable[LogEntry]) -> None:
        for entry in entries:
            self.append(entry)

    def _drop(self, db: sqlite3.Connection, counts: _Counts) -> None:
        """Drop the oldest tail entries down to three quarters of the tail's share (a quarter
        at a time, not a row per append), and say so in the marker entry."""
        assert counts.boundary is not None
        excess = counts.tail_bytes - self.half * 3 // 4
        rows = db.execute(
            "SELECT seq, ts, size FROM log WHERE seq > ? ORDER BY seq", (counts.boundary,)
        )
        freed = lines = dropped = 0
        first_ts = last = None
        for seq, ts, size in rows:
            first_ts = ts if first_ts is None else first_ts
            freed += size + ENTRY_OVERHEAD
            dropped += size
            lines += 1
            last = seq
            if freed >= excess:
                break
        rows.close()
        if last is None:
            return
        db.execute("DELETE FROM log WHERE seq > ? AND seq <= ?", (counts.boundary, last))
        counts.tail_bytes -= freed
        counts.dropped_lines += lines
        counts.dropped_bytes += dropped
        marker = (
            f"[{counts.dropped_lines} lines ({counts.dropped_bytes} bytes) of this log dropped: "
            f"a build's log keeps its first and last {self.half} bytes, build_log_max_mb]"
        )
        db.execute(
            "INSERT INTO log VALUES (?, ?, ?, NULL, ?, 0) ON CONFLICT (seq) DO UPDATE"
            " SET message = excluded.message",
            (counts.boundary, first_ts, _WARN, marker),
        )

    def _commit(self) -> None:
        if self._db is None:
            return
        c = self._counts
        self._db.execute(
            "INSERT OR REPLACE INTO meta VALUES (0, ?, ?, ?, ?, ?, ?)",
            (c.next_seq, c.boundary, c.head_bytes, c.tail_bytes, c.dropped_lines,
             c.dropped_bytes),
        )  # fmt: skip
        self._db.commit()
        self._pending = 0

    def flush(self) -> None:
        """Commit what was appended, for readers to see."""
        if self._db is not None and self._pending:
            self._commit()

    def close(self) -> None:
        """Commit and close: the build writes no more (an append would open it again). Back in
        rollback-journal mode, read-only readers of the finished log leave no WAL files; a
        reader at that moment keeps it in WAL mode (its files go with the log)."""
        if self._db is not None:
            self._commit()
            with contextlib.suppress(sqlite3.OperationalError):  # "database is locked"
                self._db.execute("PRAGMA journal_mode = DELETE")
            self._db.close()
            self._db = None

    def delete(self) -> None:
        self.close()
        for suffix in ("", "-journal", "-wal", "-shm"):
            self.path.with_name(self.path.name + suffix).unlink(missing_ok=True)

    def _query(self, sql: str, params: tuple[object, ...] | dict[str, object]) -> list[LogEntry]:
        try:
            with contextlib.closing(sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)) as db:
                rows = db.execute(sql, params).fetchall()
        except sqlite3.OperationalError:
            if not self.path.exists():  # nothing logged yet, or the build is gone
                return []
            raise
        return [LogEntry(ts, LEVELS[level], message, step) for ts, level, step, message in rows]

    def page(self, offset: int, limit: int, level: str = LEVELS[0]) -> list[LogEntry]:
        """The entries at `level` or above, from position `offset` on (the status route).
        Blocking: run it in a thread, after `flush` in the writer's."""
        return self._query(
            "SELECT ts, level, step, message FROM log WHERE level >= ? ORDER BY seq"
            " LIMIT ? OFFSET ?",
            (LEVELS.index(level), limit, offset),
        )

    def around(
        self, cursor_ms: int | None, limit: int, backward: bool, level: str = LEVELS[0]
    ) -> list[LogEntry]:
        """The entries at `level` or above from `cursor_ms` (Unix ms) on, oldest first, or
        before it, newest first (the logs route); all of them without a cursor. Blocking: run it
        in a thread, after `flush` in the writer's."""
        return self._query(
            "SELECT ts, level, step, message FROM log WHERE level >= :level AND (:cursor IS NULL"
            " OR (CASE WHEN :backward THEN ts * 1000 < :cursor ELSE ts * 1000 >= :cursor END))"
            " ORDER BY CASE WHEN :backward THEN -seq ELSE seq END LIMIT :limit",
            {"level": LEVELS.index(level), "cursor": cursor_ms, "backward": backward,
             "limit": limit},
        )  # fmt: skip
