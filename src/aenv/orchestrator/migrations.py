"""Catalogs written by older versions, brought up to the current schema when a node opens them,
so a node's paused sandboxes survive an upgrade.

1. Columns added since the first release are added with their defaults.
2. The untyped `placement` JSON column of earlier versions is spread over the typed columns
   that replaced it (`restored_from`, `timeout`, `auto_pause_mode`, `internal`,
   `checkpoint_seq`, `checkpoint_mode`, `archive_seq`, `archive_manifest`), then dropped.
3. The `allow_internet` flag, all earlier versions kept of a sandbox's network settings, is
   copied into the `network` column when that is added (the old column stays, unused).
4. The `volumes` table is created (catalogs older than volumes have none); sandboxes of those
   catalogs mount no volume (`volume_mounts` defaults to an empty list).
5. Volumes get `size_mb`; those made before it keep NULL: plain directories, unbounded.

All run in the caller's transaction: a crash leaves the old catalog or the new one.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from aenv.orchestrator.kinds import SaveMode

# Columns added after the first release, with their DDL for `ALTER TABLE`.
ADDED_COLUMNS = {
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
# The volumes of the node (`orchestrator.volumes`), added with them.
VOLUMES_TABLE = """
CREATE TABLE IF NOT EXISTS volumes (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    token TEXT NOT NULL,
    created_at REAL NOT NULL,
    size_mb INTEGER
)
"""
_FROM_ALLOW_INTERNET = (
    "UPDATE sandboxes SET network = json_object('allow_internet', json("
    "CASE allow_internet WHEN 0 THEN 'false' ELSE 'true' END))"
)


def upgrade(db: sqlite3.Connection) -> None:
    db.execute(VOLUMES_TABLE)
    if "size_mb" not in {row[1] for row in db.execute("PRAGMA table_info(volumes)")}:
        db.execute("ALTER TABLE volumes ADD COLUMN size_mb INTEGER")
    have = {row[1] for row in db.execute("PRAGMA table_info(sandboxes)")}
    for name, ddl in ADDED_COLUMNS.items():
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
