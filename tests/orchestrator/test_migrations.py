"""An upgrade keeps a node's sandboxes and templates: a catalog and `template.json` files as the
previous version wrote them (the untyped `placement` column, the `memory` flag, kind `layer`)
load with every value in its typed field."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from aenv.network.settings import SandboxNetwork
from aenv.orchestrator.catalog import (
    Archived,
    Catalog,
    PageQuery,
    SandboxRecord,
    VolumeMount,
    VolumeRecord,
)
from aenv.orchestrator.kinds import SaveMode, TemplateKind
from aenv.orchestrator.migrations import MIGRATIONS, SCHEMA_VERSION, NewerCatalog, upgrade
from aenv.orchestrator.states import SandboxState
from aenv.orchestrator.templates import TemplateStore
from tests.doubles.node import double_node

# The sandboxes table exactly as the previous version created it.
OLD_SCHEMA = """
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
    placement TEXT NOT NULL DEFAULT '{}',
    updated_at REAL NOT NULL
);
CREATE INDEX sandboxes_state ON sandboxes(state);
CREATE INDEX sandboxes_started ON sandboxes(started_at, id);
"""


def _old_row(
    db: sqlite3.Connection, sandbox_id: str, state: str, placement: dict[str, object]
) -> None:
    db.execute(
        "INSERT INTO sandboxes (id, template_id, alias, state, metadata, env_vars, cpu_count,"
        " memory_mb, disk_size_mb, started_at, end_at, envd_access_token, auto_pause,"
        " placement, updated_at) VALUES (?, 'tpl', 'base', ?, '{\"k\": \"v\"}', '{}', 1, 512,"
        " 2048, 10.0, 20.0, 'tok', 1, ?, 11.0)",
        (sandbox_id, state, json.dumps(placement)),
    )


def test_old_catalog_keeps_its_paused_sandboxes(tmp_path: Path) -> None:
    path = tmp_path / "catalog.db"
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    _old_row(
        db,
        "paused1",
        "paused",
        {
            "base": "/home/templates/tpl/snapshot",
            "timeout": 600,
            "pause_memory": False,
            "seq": 4,
            "memory": False,
            "archive": {"seq": 3, "manifest": "man-3"},
        },
    )
    _old_row(db, "build1", "running", {"base": "/b", "internal": True, "seq": 0})
    _old_row(db, "bare1", "paused", {})
    db.commit()
    db.close()

    catalog = Catalog(path)
    try:
        paused = catalog.get("paused1")
        assert paused is not None
        assert paused.state is SandboxState.PAUSED
        assert paused.metadata == {"k": "v"} and paused.envd_access_token == "tok"
        assert paused.restored_from == "/home/templates/tpl/snapshot"
        assert paused.timeout == 600
        assert paused.auto_pause_mode is SaveMode.FILESYSTEM
        assert paused.checkpoint_seq == 4
        assert paused.checkpoint_mode is SaveMode.FILESYSTEM
        assert paused.archived == Archived(3, "man-3")
        build = catalog.get("build1")
        assert build is not None and build.internal and build.archived is None
        bare = catalog.get("bare1")
        assert bare is not None
        assert (bare.timeout, bare.checkpoint_seq, bare.checkpoint_mode) == (300, 0, SaveMode.FULL)
        # `internal` is a column now: listings filter on it in SQL.
        query = PageQuery(states=frozenset(SandboxState), limit=10)
        assert {r.id for r in catalog.page(query)[0]} == {"paused1", "bare1"}
        # The upgraded catalog takes the new code's writes.
        moved = catalog.transition("paused1", [SandboxState.PAUSED], SandboxState.RESUMING)
        assert moved is not None and moved.archived == Archived(3, "man-3")
    finally:
        catalog.close()
    columns = {row[1] for row in sqlite3.connect(path).execute("PRAGMA table_info(sandboxes)")}
    assert "placement" not in columns
    reopened = Catalog(path)  # a second open finds nothing left to migrate
    try:
        assert reopened.get("paused1") == moved
    finally:
        reopened.close()


def test_old_catalog_keeps_the_internet_flag_of_its_sandboxes(tmp_path: Path) -> None:
    path = tmp_path / "catalog.db"
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    _old_row(db, "offline1", "paused", {})
    _old_row(db, "online1", "paused", {})
    db.execute("UPDATE sandboxes SET allow_internet = 0 WHERE id = 'offline1'")
    db.commit()
    db.close()
    catalog = Catalog(path)
    try:
        offline, online = catalog.get("offline1"), catalog.get("online1")
        assert offline is not None and offline.network == SandboxNetwork(allow_internet=False)
        assert online is not None and online.network == SandboxNetwork()
    finally:
        catalog.close()


def _old_template(directory: Path, template_id: str, kind: str, memory: bool) -> None:
    snapshot_dir = directory / template_id / "build1"
    snapshot_dir.mkdir(parents=True)
    raw = {
        "template_id": template_id,
        "build_id": "build1",
        "aliases": [],
        "cpu_count": 1,
        "memory_mb": 512,
        "disk_size_mb": 2048,
        "envd_version": "0.1.0",
        "envd_access_token": "tok",
        "created_at": 1.0,
        "snapshot_dir": str(snapshot_dir),
        "kind": kind,
        "memory": memory,
        # A repository copy: the store keeps the template although its files are not here.
        "manifest_id": "man",
    }
    (directory / template_id / "template.json").write_text(json.dumps(raw))


def test_old_template_files_load_with_typed_kinds(tmp_path: Path) -> None:
    directory = tmp_path / "templates"
    _old_template(directory, "layer-abc", "layer", True)
    _old_template(directory, "image-def", "layer", True)
    _old_template(directory, "snap1", "snapshot", False)
    store = TemplateStore(directory, tmp_path / "memory")
    store.load()
    layer, image, snap = (store.by_id(i) for i in ("layer-abc", "image-def", "snap1"))
    assert layer is not None and layer.kind is TemplateKind.BUILD_LAYER
    assert image is not None and image.kind is TemplateKind.IMAGE_BASE
    assert snap is not None and snap.kind is TemplateKind.SNAPSHOT
    assert snap.save_mode is SaveMode.FILESYSTEM and layer.save_mode is SaveMode.FULL
    # Saved again, it is written the new way and reads back the same.
    store.save(snap)
    assert (
        json.loads((directory / "snap1" / "template.json").read_text())["save_mode"] == "filesystem"
    )
    again = TemplateStore(directory, tmp_path / "memory")
    again.load()
    assert again.by_id("snap1") == snap


async def test_paused_sandbox_survives_the_upgrade(tmp_path: Path) -> None:
    """A node pauses a sandbox; its catalog and templates are rewritten as the previous version
    kept them; the upgraded node finds the sandbox paused and resumes it intact."""
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request(timeout=77))
        node.guest(record.id).write("/work", "before the upgrade")
        await node.orchestrator.pause(record.id, mode=SaveMode.FULL)
        paused = node.row(record.id)
        await node.orchestrator.close()
        node.catalog.close()
        _downgrade_catalog(node.config.paths.catalog, paused)
        for meta in node.config.paths.templates.glob("*/template.json"):
            raw = json.loads(meta.read_text())
            raw["memory"] = raw.pop("save_mode") == "full"
            meta.write_text(json.dumps(raw))

        upgraded = node.reopen()
        await upgraded.orchestrator.start()
        row = upgraded.row(record.id)
        assert (row.state, row.checkpoint_seq, row.timeout) == (SandboxState.PAUSED, 1, 77)
        assert row.restored_from == paused.restored_from
        await upgraded.orchestrator.resume(record.id, 60)
        assert upgraded.guest(record.id).read("/work") == "before the upgrade"
        node.orchestrator = upgraded.orchestrator
        node.catalog = upgraded.catalog


def _downgrade_catalog(path: Path, record: SandboxRecord) -> None:
    """Replace the catalog by one of the previous version's schema holding `record`."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    placement: dict[str, object] = {
        "base": record.restored_from,
        "timeout": record.timeout,
        "pause_memory": record.auto_pause_mode is SaveMode.FULL,
        "seq": record.checkpoint_seq,
        "memory": record.checkpoint_mode is SaveMode.FULL,
    }
    if record.archived is not None:
        placement["archive"] = {"seq": record.archived.seq, "manifest": record.archived.manifest}
    db.execute(
        "INSERT INTO sandboxes (id, template_id, alias, state, metadata, env_vars, cpu_count,"
        " memory_mb, disk_size_mb, started_at, end_at, envd_access_token, auto_pause,"
        " placement, updated_at) VALUES (?, ?, ?, 'paused', '{}', '{}', ?, ?, ?, ?, ?, ?, 0, ?, 0)",
        (
            record.id,
            record.template_id,
            record.alias,
            record.cpu_count,
            record.memory_mb,
            record.disk_size_mb,
            record.started_at,
            record.end_at,
            record.envd_access_token,
            json.dumps(placement),
        ),
    )
    db.commit()
    db.close()


def test_old_catalog_gains_volumes(tmp_path: Path) -> None:
    path = tmp_path / "catalog.db"
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    _old_row(db, "paused1", "paused", {})
    db.commit()
    db.close()
    catalog = Catalog(path)
    try:
        old = catalog.get("paused1")
        assert old is not None and old.volume_mounts == ()
        catalog.insert_volume(VolumeRecord("vol_1", "data", "token", 1.0))
        mounted = catalog.update("paused1", volume_mounts=(VolumeMount("vol_1", "/data"),))
        assert mounted is not None and mounted.volume_mounts == (VolumeMount("vol_1", "/data"),)
    finally:
        catalog.close()
    reopened = Catalog(path)
    try:
        assert [v.name for v in reopened.volumes()] == ["data"]
        assert reopened.get("paused1") == mounted
    finally:
        reopened.close()


def test_volumes_of_a_catalog_before_sizes_have_none(tmp_path: Path) -> None:
    path = tmp_path / "catalog.db"
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    db.execute(
        "CREATE TABLE volumes (id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE,"
        " token TEXT NOT NULL, created_at REAL NOT NULL)"
    )
    db.execute("INSERT INTO volumes VALUES ('vol_old', 'old', 'token', 1.0)")
    db.commit()
    db.close()
    catalog = Catalog(path)
    try:
        assert catalog.volume(volume_id="vol_old") == VolumeRecord("vol_old", "old", "token", 1.0)
        catalog.insert_volume(VolumeRecord("vol_new", "new", "token", 2.0, 64))
        assert [v.size_mb for v in catalog.volumes()] == [None, 64]
    finally:
        catalog.close()


# The catalog as the last version before schema numbers made it (`Catalog.__init__` at
# cb523f7): today's columns, `PRAGMA user_version` 0.
UNNUMBERED_SCHEMA = """
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
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
CREATE INDEX IF NOT EXISTS sandboxes_started ON sandboxes(started_at, id);
CREATE TABLE IF NOT EXISTS volumes (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    token TEXT NOT NULL,
    created_at REAL NOT NULL,
    size_mb INTEGER
);
"""


def _user_version(path: Path) -> int:
    db = sqlite3.connect(path)
    try:
        return int(db.execute("PRAGMA user_version").fetchone()[0])
    finally:
        db.close()


def test_unnumbered_catalog_is_numbered_in_place(tmp_path: Path) -> None:
    path = tmp_path / "catalog.db"
    db = sqlite3.connect(path)
    db.executescript(UNNUMBERED_SCHEMA)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(
        "INSERT INTO sandboxes (id, template_id, state, metadata, env_vars, cpu_count,"
        " memory_mb, disk_size_mb, started_at, end_at, envd_access_token, updated_at,"
        " restored_from, timeout, checkpoint_seq, checkpoint_mode, archive_seq,"
        " archive_manifest, network, volume_mounts) VALUES ('paused1', 'tpl', 'paused', ?,"
        " '{}', 2, 512, 2048, 10.0, 20.0, 'tok', 11.0, '/t/tpl/b1', 90, 3, 'filesystem', 2,"
        " 'man-2', ?, ?)",
        (
            json.dumps({"k": "v"}),
            json.dumps({"allow_internet": False}),
            json.dumps([{"volumeID": "vol_1", "path": "/data"}]),
        ),
    )
    db.execute("INSERT INTO volumes VALUES ('vol_1', 'data', 'vtok', 1.0, 64)")
    db.commit()
    db.close()
    assert _user_version(path) == 0

    catalog = Catalog(path)
    try:
        paused = catalog.get("paused1")
        assert paused is not None and paused.state is SandboxState.PAUSED
        assert (paused.cpu_count, paused.timeout, paused.restored_from) == (2, 90, "/t/tpl/b1")
        assert (paused.checkpoint_seq, paused.checkpoint_mode) == (3, SaveMode.FILESYSTEM)
        assert paused.archived == Archived(2, "man-2")
        assert paused.network == SandboxNetwork(allow_internet=False)
        assert paused.volume_mounts == (VolumeMount("vol_1", "/data"),)
        assert catalog.volumes() == [VolumeRecord("vol_1", "data", "vtok", 1.0, 64)]
        moved = catalog.transition("paused1", [SandboxState.PAUSED], SandboxState.RESUMING)
        assert moved is not None
    finally:
        catalog.close()
    assert _user_version(path) == SCHEMA_VERSION
    reopened = Catalog(path)
    try:
        assert reopened.get("paused1") == moved
    finally:
        reopened.close()


def test_a_new_catalog_is_numbered(tmp_path: Path) -> None:
    path = tmp_path / "catalog.db"
    Catalog(path).close()
    assert _user_version(path) == SCHEMA_VERSION


def test_catalog_of_a_newer_version_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "catalog.db"
    catalog = Catalog(path)
    catalog.insert_volume(VolumeRecord("vol_1", "data", "token", 1.0))
    catalog.close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    # A newer version's change this one cannot read.
    db.execute("ALTER TABLE volumes RENAME COLUMN token TO secret")
    db.commit()
    db.close()
    before = path.read_bytes()

    with pytest.raises(NewerCatalog) as refused:
        Catalog(path)
    message = str(refused.value)
    assert f"schema version {SCHEMA_VERSION + 1}" in message and str(path) in message
    assert f"knows up to {SCHEMA_VERSION}" in message
    assert path.read_bytes() == before
    assert _user_version(path) == SCHEMA_VERSION + 1


def test_migrations_run_once_each_in_order(tmp_path: Path) -> None:
    """A catalog at the current version gets only the migrations after it, in order; a
    second open finds none left to run."""
    path = tmp_path / "catalog.db"
    Catalog(path).close()
    ran: list[str] = []

    def _create_log(db: sqlite3.Connection) -> None:
        ran.append("create")
        db.execute("CREATE TABLE log (n INTEGER)")

    def _fill_log(db: sqlite3.Connection) -> None:
        ran.append("fill")
        db.execute("INSERT INTO log VALUES (3)")

    later = (*MIGRATIONS, _create_log, _fill_log)
    for _ in range(2):
        db = sqlite3.connect(path, isolation_level=None)
        try:
            db.execute("BEGIN IMMEDIATE")
            upgrade(db, str(path), later)
            db.execute("COMMIT")
            assert db.execute("SELECT n FROM log").fetchall() == [(3,)]
        finally:
            db.close()
    assert ran == ["create", "fill"]
    assert _user_version(path) == len(later)
    with pytest.raises(NewerCatalog):
        Catalog(path)
