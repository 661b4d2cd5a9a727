"""The node's durable sandbox catalog in SQLite (WAL).

Every state change is one conditional UPDATE (`... WHERE state IN (...)`), so two concurrent
operations on one sandbox cannot both win, and a crash never leaves a row half-written. Rows are
small and statements take microseconds, so they run on the event loop's thread: a thread hop
would cost more than the statement.
"""

from __future__ import annotations

import builtins
import contextlib
import enum
import json
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypedDict, Unpack

from aenv.ids import TEAM_ID
from aenv.network.settings import SandboxNetwork
from aenv.orchestrator.kinds import SaveMode
from aenv.orchestrator.migrations import upgrade
from aenv.orchestrator.states import SandboxState, check_transition
from aenv.storage.private import private_file

# The timeout of rows written before it was recorded (an automatic resume runs this long).
DEFAULT_TIMEOUT = 300


@dataclass(frozen=True)
class Archived:
    """A pause checkpoint's copy in the snapshot repository."""

    seq: int
    manifest: str


@dataclass(frozen=True)
class VolumeRecord:
    """A volume of the node: a directory under `Paths.volumes` named by `id`. `token` is what
    E2B clients present to the volume content API. `size_mb` bounds its files (an image of that
    size, `storage.volume_images`); None for a volume made before sizes, a plain directory."""

    id: str
    name: str
    token: str
    created_at: float
    size_mb: int | None = None
    team_id: str = TEAM_ID  # names are unique within a team


class VolumeNameTaken(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"a volume named '{name}' already exists")


@dataclass(frozen=True)
class VolumeMount:
    """A volume mounted into a sandbox's guest at `path` (an absolute, normalised path)."""

    volume_id: str
    path: str

    def to_json(self) -> dict[str, str]:
        return {"volumeID": self.volume_id, "path": self.path}

    @classmethod
    def from_json(cls, raw: Mapping[str, str]) -> VolumeMount:
        return cls(raw["volumeID"], raw["path"])


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
    # Egress and ingress rules (E2B's `network` and `allow_internet_access`). The old
    # `allow_internet` column stays in the schema, unused (see `migrations`).
    network: SandboxNetwork = field(default_factory=SandboxNetwork)
    updated_at: float = 0.0
    # The saved-state directory the sandbox was restored from: its disk layers stack on it, so
    # it stays while the sandbox exists.
    restored_from: str = ""
    # The timeout it was created with; an automatic resume (proxy traffic) runs this long.
    timeout: int = DEFAULT_TIMEOUT
    # What an automatic pause on timeout saves.
    auto_pause_mode: SaveMode = SaveMode.FULL
    # The server's own sandboxes (template build VMs): never listed, killed at shutdown.
    internal: bool = False
    # The number of its newest pause checkpoint (0: none yet), and what that checkpoint holds.
    checkpoint_seq: int = 0
    checkpoint_mode: SaveMode = SaveMode.FULL
    # The newest checkpoint uploaded to the repository, once one is.
    archived: Archived | None = None
    # The id of the API key that created it.
    owner: str | None = None
    # The team of that key: only its keys see the sandbox; its limits count it.
    team_id: str = TEAM_ID
    # Volumes its guest mounts on every boot (see `orchestrator.volumes`).
    volume_mounts: tuple[VolumeMount, ...] = ()


class RecordChanges(TypedDict, total=False):
    """The fields of a `SandboxRecord` a transition or update may change, with their types, so
    that mypy checks every change (the id is the row's key; the state is the transition's)."""

    template_id: str
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    started_at: float
    end_at: float
    alias: str | None
    metadata: Mapping[str, str]
    env_vars: Mapping[str, str]
    envd_access_token: str | None
    traffic_access_token: str | None
    auto_pause: bool
    auto_resume: bool
    network: SandboxNetwork
    restored_from: str
    timeout: int
    auto_pause_mode: SaveMode
    internal: bool
    checkpoint_seq: int
    checkpoint_mode: SaveMode
    archived: Archived | None
    owner: str | None
    team_id: str
    volume_mounts: tuple[VolumeMount, ...]


@dataclass(frozen=True)
class PageQuery:
    """One page of a filtered listing, ordered by (started_at, id); `after` is the key of the
    previous page's last row. Every filter runs in SQL, so a page costs the same however many
    sandboxes the node holds."""

    states: frozenset[SandboxState]
    limit: int
    team_id: str = TEAM_ID
    metadata: Mapping[str, str] = field(default_factory=dict)
    template: str | None = None  # a template id or alias
    started_after: float | None = None
    ascending: bool = False
    after: tuple[float, str] | None = None


_JSON = ("metadata", "env_vars")
_BOOL = ("auto_pause", "auto_resume", "internal")
_MODES = ("auto_pause_mode", "checkpoint_mode")
_FIELDS = tuple(f.name for f in fields(SandboxRecord))
_COLUMNS = (*(n for n in _FIELDS if n != "archived"), "archive_seq", "archive_manifest")


def _to_columns(name: str, value: Any) -> dict[str, Any]:
    """The column values that store record field `name`."""
    if name == "archived":
        return {
            "archive_seq": value.seq if value else None,
            "archive_manifest": value.manifest if value else None,
        }
    if name in _JSON:
        return {name: json.dumps(dict(value), sort_keys=True)}
    if name == "network":
        return {name: json.dumps(value.to_json(), sort_keys=True)}
    if name == "volume_mounts":
        return {name: json.dumps([m.to_json() for m in value])}
    if name in _BOOL:
        return {name: int(value)}
    if isinstance(value, enum.Enum):
        return {name: value.value}
    return {name: value}


def _to_row(record: SandboxRecord) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for name in _FIELDS:
        row.update(_to_columns(name, getattr(record, name)))
    return row


def _from_row(row: sqlite3.Row | Mapping[str, Any]) -> SandboxRecord:
    data: dict[str, Any] = {name: row[name] for name in _FIELDS if name != "archived"}
    for name in _JSON:
        data[name] = json.loads(data[name])
    for name in _BOOL:
        data[name] = bool(data[name])
    for name in _MODES:
        data[name] = SaveMode(data[name])
    data["state"] = SandboxState(data["state"])
    data["network"] = SandboxNetwork.from_json(json.loads(data["network"]))
    data["volume_mounts"] = tuple(
        VolumeMount.from_json(m) for m in json.loads(data["volume_mounts"])
    )
    if row["archive_manifest"] is not None:
        data["archived"] = Archived(row["archive_seq"], row["archive_manifest"])
    return SandboxRecord(**data)


def record_to_json(record: SandboxRecord) -> str:
    """The record as JSON (its catalog row): how a sandbox travels to another node's catalog."""
    return json.dumps(_to_row(record), sort_keys=True)


def record_from_json(text: str) -> SandboxRecord:
    """The record `record_to_json` wrote; raises `ValueError` (or `KeyError`) when malformed.
    A node from before teams sends no team: its sandboxes were the default team's."""
    row = json.loads(text)
    if not isinstance(row, dict):
        raise ValueError("a sandbox record is a JSON object")
    return _from_row({"team_id": TEAM_ID, **row})


class Catalog:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Tokens and env vars are stored here: 0600. SQLite gives new -wal and -shm files the
        # database's mode; ones an older node left get it here.
        for file in (path, path.with_name(f"{path.name}-wal"), path.with_name(f"{path.name}-shm")):
            if file == path or file.exists():
                private_file(file)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA busy_timeout=5000")
        with ExitStack() as undo:
            undo.callback(self._db.close)
            # Before WAL is switched on: a catalog it refuses is left byte for byte.
            with self._transaction() as db:
                upgrade(db, str(path))
            undo.pop_all()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        # Told after every state change or removal of a sandbox: room may have freed
        # (creates waiting for capacity listen).
        self.changed: builtins.list[Callable[[], None]] = []

    def close(self) -> None:
        self._db.close()

    @property
    def db(self) -> sqlite3.Connection:
        """The connection, for the tables that other modules own in this file (events,
        webhooks): one file, one schema version, one writer on the event loop's thread."""
        return self._db

    def transaction(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE): all of it is committed, or none."""
        return self._transaction()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        with ExitStack() as undo:
            undo.callback(self._db.execute, "ROLLBACK")
            yield self._db
            undo.pop_all()
        self._db.execute("COMMIT")

    def insert(self, record: SandboxRecord) -> SandboxRecord:
        record = replace(record, updated_at=time.time())
        row = _to_row(record)
        marks = ", ".join("?" for _ in row)
        self._db.execute(
            f"INSERT INTO sandboxes ({', '.join(row)}) VALUES ({marks})",  # noqa: S608
            tuple(row.values()),
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
        **changes: Unpack[RecordChanges],
    ) -> SandboxRecord | None:
        """Move to `to` (and apply `changes`) only if the current state is in `allowed_from`.
        Returns the updated record, or None when the sandbox is missing or in another state.
        Raises `IllegalTransition` for a move `states.TRANSITIONS` does not allow."""
        allowed = frozenset(allowed_from)
        check_transition(allowed, to)
        assignments: dict[str, Any] = {"state": to.value, "updated_at": time.time()}
        for name, value in changes.items():
            if name not in RecordChanges.__annotations__:  # a caller mypy did not check
                raise ValueError(f"not a changeable field: {name}")
            assignments.update(_to_columns(name, value))
        sets = ", ".join(f"{name} = ?" for name in assignments)
        marks = ", ".join("?" for _ in allowed)
        with self._transaction() as db:
            cursor = db.execute(
                f"UPDATE sandboxes SET {sets} WHERE id = ? AND state IN ({marks})",  # noqa: S608
                (*assignments.values(), sandbox_id, *(s.value for s in allowed)),
            )
            if cursor.rowcount != 1:
                return None
            row = db.execute("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
        self._tell()
        return _from_row(row)

    def update(self, sandbox_id: str, **changes: Unpack[RecordChanges]) -> SandboxRecord | None:
        """Change fields without a state transition (e.g. end_at), whatever the state."""
        current = self.get(sandbox_id)
        if current is None:
            return None
        return self.transition(sandbox_id, [current.state], current.state, **changes)

    def delete(self, sandbox_id: str) -> bool:
        cursor = self._db.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))
        if cursor.rowcount != 1:
            return False
        self._tell()
        return True

    def _tell(self) -> None:
        for listener in self.changed:
            listener()

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
            "internal = 0",  # the server's own sandboxes
            "team_id = ?",
        ]
        params: list[Any] = [*states, query.team_id]
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

    # -- volumes --------------------------------------------------------------------------

    def insert_volume(self, volume: VolumeRecord) -> None:
        """Raises `VolumeNameTaken` when another volume has its name (names are unique)."""
        try:
            self._db.execute(
                "INSERT INTO volumes (id, name, token, created_at, size_mb, team_id)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (
                    volume.id,
                    volume.name,
                    volume.token,
                    volume.created_at,
                    volume.size_mb,
                    volume.team_id,
                ),
            )
        except sqlite3.IntegrityError as e:
            raise VolumeNameTaken(volume.name) from e

    def volume(
        self, *, volume_id: str | None = None, name: str | None = None, team_id: str = TEAM_ID
    ) -> VolumeRecord | None:
        """The volume with this id, or the one of `team_id` with this name."""
        if volume_id is not None:
            row = self._db.execute("SELECT * FROM volumes WHERE id = ?", (volume_id,)).fetchone()
        else:
            row = self._db.execute(
                "SELECT * FROM volumes WHERE name = ? AND team_id = ?", (name, team_id)
            ).fetchone()
        return VolumeRecord(**dict(row)) if row else None

    def volumes(self, team_id: str | None = None) -> builtins.list[VolumeRecord]:
        """Every volume; of `team_id` only, when given."""
        if team_id is None:
            rows = self._db.execute("SELECT * FROM volumes ORDER BY created_at, id")
        else:
            rows = self._db.execute(
                "SELECT * FROM volumes WHERE team_id = ? ORDER BY created_at, id", (team_id,)
            )
        return [VolumeRecord(**dict(row)) for row in rows]

    def delete_volume(self, volume_id: str) -> bool:
        cursor = self._db.execute("DELETE FROM volumes WHERE id = ?", (volume_id,))
        return cursor.rowcount == 1
