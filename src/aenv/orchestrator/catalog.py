"""The node's durable sandbox catalog in SQLite (WAL).

Every state change is one conditional UPDATE (`... WHERE state IN (...)`), so two concurrent
operations on one sandbox cannot both win, and a crash never leaves a row half-written. Rows are
small and statements take microseconds, so they run on the event loop's thread: a thread hop
would cost more than the statement.
"""

from __future__ import annotations

import builtins
import json
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from aenv.network.settings import SandboxNetwork
from aenv.orchestrator.states import SandboxState

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    template_id TEXT NOT NULL,
    alias TEXT,
    state TEXT NOT NULL,
    metadata TEXT NOT NULL,
    env_vars TEXT NOT NULL,
    cpu_count INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL,
    disk_size_mb INTEGER NOT NULL,
    started_at REAL NOT NULL,
    end_at REAL NOT NULL,
    envd_access_token TEXT,
    traffic_access_token TEXT,
    auto_pause INTEGER NOT NULL DEFAULT 0,
    auto_resume INTEGER NOT NULL DEFAULT 0,
    allow_internet INTEGER NOT NULL DEFAULT 1,
    placement TEXT NOT NULL DEFAULT '{}',
    network TEXT NOT NULL DEFAULT '{}',
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
CREATE INDEX IF NOT EXISTS sandboxes_started ON sandboxes(started_at, id);
"""


@dataclass(frozen=True)
class SandboxRecord:
    id: str
    template_id: str
    state: SandboxState
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    started_at: float
    end_at: float
    alias: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    env_vars: Mapping[str, str] = field(default_factory=dict)
    envd_access_token: str | None = None
    traffic_access_token: str | None = None
    auto_pause: bool = False
    auto_resume: bool = False
    # Egress and ingress rules (E2B's `network` and `allow_internet_access`).
    network: SandboxNetwork = field(default_factory=SandboxNetwork)
    # Where the sandbox runs on this node (VM work dir, network slot): the runtime's business,
    # kept here so a restarted server can find and reclaim it.
    placement: Mapping[str, Any] = field(default_factory=dict)
    updated_at: float = 0.0


@dataclass(frozen=True)
class PageQuery:
    """One page of a filtered listing, ordered by (started_at, id); `after` is the key of the
    previous page's last row. Every filter runs in SQL, so a page costs the same however many
    sandboxes the node holds."""

    states: frozenset[SandboxState]
    limit: int
    metadata: Mapping[str, str] = field(default_factory=dict)
    template: str | None = None  # a template id or alias
    started_after: float | None = None
    ascending: bool = False
    after: tuple[float, str] | None = None


# Columns added after the first release, with their DDL for `ALTER TABLE`.
_ADDED_COLUMNS = {
    "auto_resume": "INTEGER NOT NULL DEFAULT 0",
    "network": "TEXT NOT NULL DEFAULT '{}'",
}
# Rows written before `network` existed kept only this flag, in the column of that name (which
# stays in the schema, unused, so such catalogs need no table rebuild).
_FROM_ALLOW_INTERNET = (
    "UPDATE sandboxes SET network = json_object('allow_internet', json("
    "CASE allow_internet WHEN 0 THEN 'false' ELSE 'true' END))"
)
_JSON = ("metadata", "env_vars", "placement")
_BOOL = ("auto_pause", "auto_resume")
_COLUMNS = tuple(f.name for f in fields(SandboxRecord))


def _encode(name: str, value: Any) -> Any:
    if name in _JSON:
        return json.dumps(dict(value), sort_keys=True)
    if name in _BOOL:
        return int(value)
    if name == "network":
        return json.dumps(value.to_json(), sort_keys=True)
    return value


def _to_row(record: SandboxRecord) -> tuple[Any, ...]:
    values = []
    for name in _COLUMNS:
        value = getattr(record, name)
        values.append(value.value if name == "state" else _encode(name, value))
    return tuple(values)


def _from_row(row: sqlite3.Row) -> SandboxRecord:
    data: dict[str, Any] = {name: row[name] for name in _COLUMNS}
    for name in _JSON:
        data[name] = json.loads(data[name])
    for name in _BOOL:
        data[name] = bool(data[name])
    data["state"] = SandboxState(data["state"])
    data["network"] = SandboxNetwork.from_json(json.loads(data["network"]))
    return SandboxRecord(**data)


class Catalog:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(SCHEMA)
        self._add_missing_columns()

    def close(self) -> None:
        self._db.close()

    def _add_missing_columns(self) -> None:
        """Catalogs written by an older version lack newer columns; add them with defaults."""
        have = {row["name"] for row in self._db.execute("PRAGMA table_info(sandboxes)")}
        for name, ddl in _ADDED_COLUMNS.items():
            if name not in have:
                self._db.execute(f"ALTER TABLE sandboxes ADD COLUMN {name} {ddl}")
                if name == "network":
                    self._db.execute(_FROM_ALLOW_INTERNET)

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def insert(self, record: SandboxRecord) -> SandboxRecord:
        record = replace(record, updated_at=time.time())
        marks = ", ".join("?" for _ in _COLUMNS)
        self._db.execute(
            f"INSERT INTO sandboxes ({', '.join(_COLUMNS)}) VALUES ({marks})",  # noqa: S608
            _to_row(record),
        )
        return record

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        row = self._db.execute("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
        return _from_row(row) if row else None

    def transition(
        self,
        sandbox_id: str,
        allowed_from: Iterable[SandboxState],
        to: SandboxState,
        **changes: Any,
    ) -> SandboxRecord | None:
        """Move to `to` (and apply `changes`) only if the current state is in `allowed_from`.
        Returns the updated record, or None when the sandbox is missing or in another state."""
        allowed = [s.value for s in allowed_from]
        assignments = {"state": to.value, "updated_at": time.time()}
        for name, value in changes.items():
            if name not in _COLUMNS or name in ("id", "state"):
                raise ValueError(f"not a changeable column: {name}")
            assignments[name] = _encode(name, value)
        sets = ", ".join(f"{name} = ?" for name in assignments)
        marks = ", ".join("?" for _ in allowed)
        with self._transaction() as db:
            cursor = db.execute(
                f"UPDATE sandboxes SET {sets} WHERE id = ? AND state IN ({marks})",  # noqa: S608
                (*assignments.values(), sandbox_id, *allowed),
            )
            if cursor.rowcount != 1:
                return None
            row = db.execute("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
        return _from_row(row)

    def update(self, sandbox_id: str, **changes: Any) -> SandboxRecord | None:
        """Change fields without a state transition (e.g. end_at), whatever the state."""
        current = self.get(sandbox_id)
        if current is None:
            return None
        return self.transition(sandbox_id, [current.state], current.state, **changes)

    def delete(self, sandbox_id: str) -> bool:
        cursor = self._db.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))
        return cursor.rowcount == 1

    def list(self, states: Iterable[SandboxState] | None = None) -> list[SandboxRecord]:
        query = "SELECT * FROM sandboxes"
        params: list[str] = []
        if states is not None:
            wanted = [s.value for s in states]
            query += f" WHERE state IN ({', '.join('?' for _ in wanted)})"
            params = wanted
        query += " ORDER BY started_at DESC, id DESC"
        return [_from_row(row) for row in self._db.execute(query, params)]

    def page(self, query: PageQuery) -> tuple[builtins.list[SandboxRecord], bool]:
        """The rows of one page, and whether more follow."""
        states = [s.value for s in query.states]
        where = [
            f"state IN ({', '.join('?' for _ in states)})",
            "json_extract(placement, '$.internal') IS NULL",  # the server's own sandboxes
        ]
        params: list[Any] = list(states)
        for key, value in query.metadata.items():
            where.append("EXISTS (SELECT 1 FROM json_each(metadata) WHERE key = ? AND value = ?)")
            params += [key, value]
        if query.template is not None:
            where.append("(template_id = ? OR alias = ?)")
            params += [query.template, query.template]
        if query.started_after is not None:
            where.append("started_at > ?")
            params.append(query.started_after)
        if query.after is not None:
            where.append(f"(started_at, id) {'>' if query.ascending else '<'} (?, ?)")
            params += list(query.after)
        order = "ASC" if query.ascending else "DESC"
        sql = (
            f"SELECT * FROM sandboxes WHERE {' AND '.join(where)} "  # noqa: S608
            f"ORDER BY started_at {order}, id {order} LIMIT ?"
        )
        rows = self._db.execute(sql, [*params, query.limit + 1]).fetchall()
        return [_from_row(row) for row in rows[: query.limit]], len(rows) > query.limit

    def count(self, states: Iterable[SandboxState]) -> int:
        wanted = [s.value for s in states]
        marks = ", ".join("?" for _ in wanted)
        row = self._db.execute(
            f"SELECT COUNT(*) FROM sandboxes WHERE state IN ({marks})",  # noqa: S608
            wanted,
        ).fetchone()
        return int(row[0])
