"""The catalog's schema and its history: numbered migrations, each applied once, in order.

SQLite's `PRAGMA user_version` holds the number of the last migration a catalog received
(`SCHEMA_VERSION` is the newest this code knows). Opening a catalog:

1. A catalog of a newer version is refused (`NewerCatalog`) before anything is written: its
   tables may mean what this code cannot know.
2. A catalog with tables but version 0 predates the version number. Its shape is the one guess
   left: `_adopt` brings every shape earlier versions wrote up to migration 1's, then it is
   numbered 1.
3. The migrations after the catalog's version run in order, each recording its number.

All run in the caller's transaction (`PRAGMA user_version` is part of it): a crash leaves the
old catalog or the new one. A schema change is a new function at the end of `MIGRATIONS`, never
an edit of one that has shipped.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Sequence
from typing import Any

from aenv.orchestrator.kinds import SaveMode

# The team everything made before teams belongs to (`aenv.ids.TEAM_ID`); frozen here, as every
# shipped migration is.
DEFAULT_TEAM = "local"

Migration = Callable[[sqlite3.Connection], None]


class NewerCatalog(RuntimeError):
    """The catalog was written by a newer version of aenv; it was left untouched."""

    def __init__(self, path: str, version: int, known: int) -> None:
        super().__init__(
            f"the catalog {path} has schema version {version}, and this aenv knows up to"
            f" {known}: run the aenv that wrote it (or a newer one); it was left as it was"
        )


# The sandboxes table of migration 1; `SandboxRecord` documents its columns.
_SANDBOXES_TABLE = """
CREATE TABLE sandboxes (
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
    updated_at REAL NOT NULL,
    restored_from TEXT NOT NULL DEFAULT '',
    timeout INTEGER NOT NULL DEFAULT 300,
    auto_pause_mode TEXT NOT NULL DEFAULT 'full',
    internal INTEGER NOT NULL DEFAULT 0,
    checkpoint_seq INTEGER NOT NULL DEFAULT 0,
    checkpoint_mode TEXT NOT NULL DEFAULT 'full',
    archive_seq INTEGER,
    archive_manifest TEXT,
    owner TEXT,
    network TEXT NOT NULL DEFAULT '{}',
    volume_mounts TEXT NOT NULL DEFAULT '[]'
)
"""
# The volumes of the node (`orchestrator.volumes`).
_VOLUMES_TABLE = """
CREATE TABLE volumes (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    token TEXT NOT NULL,
    created_at REAL NOT NULL,
    size_mb INTEGER
)
"""


def _1_sandboxes_and_volumes(db: sqlite3.Connection) -> None:
    """The sandboxes and volumes tables as the first numbered version has them."""
    db.execute(_SANDBOXES_TABLE)
    db.execute("CREATE INDEX sandboxes_state ON sandboxes(state)")
    db.execute("CREATE INDEX sandboxes_started ON sandboxes(started_at, id)")
    db.execute(_VOLUMES_TABLE)


def _2_events(db: sqlite3.Connection) -> None:
    """Sandbox lifecycle events (`orchestrator.events`), in the order they were written."""
    db.execute(
        """CREATE TABLE events (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            id TEXT NOT NULL UNIQUE,
            type TEXT NOT NULL,
            team_id TEXT NOT NULL,
            sandbox_id TEXT NOT NULL,
            execution_id TEXT NOT NULL,
            created_at REAL NOT NULL,
            body TEXT NOT NULL
        )"""
    )
    db.execute("CREATE INDEX events_team ON events(team_id, seq)")
    db.execute("CREATE INDEX events_sandbox ON events(sandbox_id, seq)")
    db.execute("CREATE INDEX events_created ON events(created_at)")


def _3_webhooks(db: sqlite3.Connection) -> None:
    """Webhooks and their deliveries: the queue and the log in one table
    (`orchestrator.webhooks`)."""
    db.execute(
        """CREATE TABLE webhooks (
            id TEXT PRIMARY KEY,
            team_id TEXT NOT NULL,
            name TEXT NOT NULL,
            url TEXT NOT NULL,
            enabled INTEGER NOT NULL,
            events TEXT NOT NULL,
            secret TEXT NOT NULL,
            created_at REAL NOT NULL
        )"""
    )
    db.execute(
        """CREATE TABLE webhook_deliveries (
            id TEXT PRIMARY KEY,
            webhook_id TEXT NOT NULL,
            event_seq INTEGER NOT NULL,
            state TEXT NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 0,
            last_status INTEGER,
            last_error TEXT,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        )"""
    )
    db.execute("CREATE INDEX deliveries_queue ON webhook_deliveries(webhook_id, state, event_seq)")
    db.execute("CREATE INDEX deliveries_updated ON webhook_deliveries(updated_at)")


def _4_secrets(db: sqlite3.Connection) -> None:
    """Secrets and their versions, values encrypted (`orchestrator.secrets`)."""
    db.execute(
        """CREATE TABLE secrets (
            id TEXT PRIMARY KEY,
            team_id TEXT NOT NULL,
            name TEXT NOT NULL,
            current_version INTEGER NOT NULL,
            metadata TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            UNIQUE (team_id, name)
        )"""
    )
    db.execute(
        """CREATE TABLE secret_versions (
            secret_id TEXT NOT NULL,
            version INTEGER NOT NULL,
            value BLOB NOT NULL,
            created_at REAL NOT NULL,
            PRIMARY KEY (secret_id, version)
        )"""
    )


def _5_teams(db: sqlite3.Connection) -> None:
    """Teams (`orchestrator.teams`), and the team of every sandbox and volume. What a catalog
    held before teams belonged to the one team every key was in, `local` (`ids.TEAM_ID`): it
    stays that team's, so a node upgraded keeps serving its keys their sandboxes and volumes.
    Volume names become unique per team, not per node: the table is copied into one with that
    constraint (SQLite cannot change a constraint in place)."""
    db.execute(
        """CREATE TABLE teams (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,
            created_at REAL NOT NULL
        )"""
    )
    db.execute(
        "INSERT INTO teams (id, name, created_at) VALUES (?, ?, ?)",
        (DEFAULT_TEAM, DEFAULT_TEAM, time.time()),
    )
    db.execute(f"ALTER TABLE sandboxes ADD COLUMN team_id TEXT NOT NULL DEFAULT '{DEFAULT_TEAM}'")
    db.execute("CREATE INDEX sandboxes_team ON sandboxes(team_id, state)")
    db.execute(
        f"""CREATE TABLE volumes_by_team (
            id TEXT PRIMARY KEY,
            team_id TEXT NOT NULL DEFAULT '{DEFAULT_TEAM}',
            name TEXT NOT NULL,
            token TEXT NOT NULL,
            created_at REAL NOT NULL,
            size_mb INTEGER,
            UNIQUE (team_id, name)
        )"""
    )
    db.execute(
        "INSERT INTO volumes_by_team (id, name, token, created_at, size_mb)"
        " SELECT id, name, token, created_at, size_mb FROM volumes"
    )
    db.execute("DROP TABLE volumes")
    db.execute("ALTER TABLE volumes_by_team RENAME TO volumes")


MIGRATIONS: tuple[Migration, ...] = (
    _1_sandboxes_and_volumes,
    _2_events,
    _3_webhooks,
    _4_secrets,
    _5_teams,
)
SCHEMA_VERSION = len(MIGRATIONS)


def upgrade(
    db: sqlite3.Connection, path: str, migrations: Sequence[Migration] = MIGRATIONS
) -> None:
    """Bring `db` (inside a transaction) to the last of `migrations`; raises `NewerCatalog`,
    having written nothing, if it is past them."""
    current = int(db.execute("PRAGMA user_version").fetchone()[0])
    if current > len(migrations):
        raise NewerCatalog(path, current, len(migrations))
    if current == 0 and _has_table(db, "sandboxes"):
        _adopt(db)
        current = 1
        db.execute("PRAGMA user_version = 1")
    for number, migration in enumerate(migrations[current:], start=current + 1):
        migration(db)
        db.execute(f"PRAGMA user_version = {number}")


def _has_table(db: sqlite3.Connection, name: str) -> bool:
    row = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,))
    return row.fetchone() is not None


# Columns unnumbered versions added after the first release, with their DDL for `ALTER TABLE`.
_ADDED_COLUMNS = {
    "auto_resume": "INTEGER NOT NULL DEFAULT 0",
    "restored_from": "TEXT NOT NULL DEFAULT ''",
    "timeout": "INTEGER NOT NULL DEFAULT 300",  # catalog.DEFAULT_TIMEOUT
    "auto_pause_mode": "TEXT NOT NULL DEFAULT 'full'",
    "internal": "INTEGER NOT NULL DEFAULT 0",
    "checkpoint_seq": "INTEGER NOT NULL DEFAULT 0",
    "checkpoint_mode": "TEXT NOT NULL DEFAULT 'full'",
    "archive_seq": "INTEGER",
    "archive_manifest": "TEXT",
    "owner": "TEXT",
    "network": "TEXT NOT NULL DEFAULT '{}'",
    "volume_mounts": "TEXT NOT NULL DEFAULT '[]'",
}
_FROM_ALLOW_INTERNET = (
    "UPDATE sandboxes SET network = json_object('allow_internet', json("
    "CASE allow_internet WHEN 0 THEN 'false' ELSE 'true' END))"
)


def _adopt(db: sqlite3.Connection) -> None:
    """Bring a catalog of any unnumbered version to migration 1's shape. Frozen: the shapes it
    reads are those versions', and none will be added.

    1. Columns added since the first release are added with their defaults.
    2. The untyped `placement` JSON column of the first versions is spread over the typed
       columns that replaced it (`restored_from`, `timeout`, `auto_pause_mode`, `internal`,
       `checkpoint_seq`, `checkpoint_mode`, `archive_seq`, `archive_manifest`), then dropped.
    3. The `allow_internet` flag, all earlier versions kept of a sandbox's network settings, is
       copied into the `network` column when that is added (the old column stays, unused).
    4. The `volumes` table is created (catalogs older than volumes have none); sandboxes of
       those catalogs mount no volume (`volume_mounts` defaults to an empty list).
    5. Volumes get `size_mb`; those made before it keep NULL: plain directories, unbounded.
    """
    db.execute("CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state)")
    db.execute("CREATE INDEX IF NOT EXISTS sandboxes_started ON sandboxes(started_at, id)")
    if not _has_table(db, "volumes"):
        db.execute(_VOLUMES_TABLE)
    if "size_mb" not in {row[1] for row in db.execute("PRAGMA table_info(volumes)")}:
        db.execute("ALTER TABLE volumes ADD COLUMN size_mb INTEGER")
    have = {row[1] for row in db.execute("PRAGMA table_info(sandboxes)")}
    for name, ddl in _ADDED_COLUMNS.items():
        if name not in have:
            db.execute(f"ALTER TABLE sandboxes ADD COLUMN {name} {ddl}")
            if name == "network":
                db.execute(_FROM_ALLOW_INTERNET)
    if "placement" in have:
        rows = db.execute("SELECT id, placement FROM sandboxes").fetchall()
        for sandbox_id, placement in rows:
            columns = _placement_columns(json.loads(placement or "{}"))
            sets = ", ".join(f"{name} = ?" for name in columns)
            db.execute(
                f"UPDATE sandboxes SET {sets} WHERE id = ?",  # noqa: S608 - names are ours
                (*columns.values(), sandbox_id),
            )
        db.execute("ALTER TABLE sandboxes DROP COLUMN placement")


def _placement_columns(placement: dict[str, Any]) -> dict[str, Any]:
    """The typed columns for what one old `placement` held (absent keys keep the defaults)."""
    columns: dict[str, Any] = {
        "restored_from": str(placement.get("base", "")),
        "internal": int(bool(placement.get("internal", False))),
        "checkpoint_seq": int(placement.get("seq", 0)),
        "auto_pause_mode": SaveMode.of(bool(placement.get("pause_memory", True))).value,
        "checkpoint_mode": SaveMode.of(bool(placement.get("memory", True))).value,
    }
    if "timeout" in placement:
        columns["timeout"] = int(placement["timeout"])
    archive = placement.get("archive")
    if archive:
        columns["archive_seq"] = int(archive["seq"])
        columns["archive_manifest"] = str(archive["manifest"])
    return columns
