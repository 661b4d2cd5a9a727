"""Secrets (E2B's `/secrets`): named values a team stores once and header rules name
(`${e2b.secrets.<name>}`), resolved by the egress proxy when it sends a request, so a guest
only ever holds the marker.

Each secret is a row of `secrets` (its metadata, `current_version`) and one row of
`secret_versions` per value it was given; an update appends a version and points
`current_version` at it. Values are stored encrypted (AES-256-GCM, the secret's id and version
as associated data, so a ciphertext moved to another row does not decrypt) with the node's key
(`SecretKey`): a copy of the catalog alone gives nothing away. No read but `value` returns a
value, and `value` is for the egress proxy alone.

Names are lower-cased before they are stored or looked up (E2B: the canonical form); the
`sec_` prefix is the ids', so `get` finds a secret by either.
"""

from __future__ import annotations

import base64
import binascii
import builtins
import json
import os
import sqlite3
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from aenv.config import Config
from aenv.ids import TEAM_ID
from aenv.orchestrator.catalog import Catalog

ID_PREFIX = "sec_"
_KEY_BYTES = 32
_NONCE_BYTES = 12


class SecretNameTaken(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"a secret named '{name}' already exists")


@dataclass(frozen=True)
class SecretRecord:
    """A secret's metadata: never its value."""

    secret_id: str
    team_id: str
    name: str
    current_version: int
    metadata: dict[str, str]
    created_at: float
    updated_at: float


def load_key(path: Path, *, create: bool) -> bytes:
    """The key in `path` (32 bytes, base64). With `create`, a missing file is made with a new
    key, mode 0600; without, a missing or malformed file raises ValueError."""
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        key = AESGCM.generate_key(bit_length=8 * _KEY_BYTES)
        # O_EXCL: of two starts racing, one fails rather than both keeping a different key.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(base64.b64encode(key) + b"\n")
        return key
    try:
        key = base64.b64decode(path.read_bytes().strip(), validate=True)
    except (OSError, binascii.Error) as e:
        raise ValueError(f"secrets key {path}: {e}") from e
    if len(key) != _KEY_BYTES:
        raise ValueError(f"secrets key {path}: {len(key)} bytes, not {_KEY_BYTES} (base64)")
    return key


def node_key(config: Config) -> bytes:
    """The node's key: the operator's file, or one generated under the node's home."""
    given = config.secrets_key_file
    return load_key(given or config.paths.secrets_key, create=given is None)


def _from_row(row: sqlite3.Row) -> SecretRecord:
    return SecretRecord(
        secret_id=row["id"],
        team_id=row["team_id"],
        name=row["name"],
        current_version=row["current_version"],
        metadata=json.loads(row["metadata"]),
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )


class SecretStore:
    """The `secrets` and `secret_versions` tables; every read is scoped to a team."""

    def __init__(self, catalog: Catalog, key: bytes) -> None:
        self.catalog = catalog
        self._aead = AESGCM(key)

    def _seal(self, secret_id: str, version: int, value: str) -> bytes:
        nonce = os.urandom(_NONCE_BYTES)
        aad = f"{secret_id}/{version}".encode()
        return nonce + self._aead.encrypt(nonce, value.encode(), aad)

    def _open(self, secret_id: str, version: int, sealed: bytes) -> str:
        aad = f"{secret_id}/{version}".encode()
        nonce, ciphertext = sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:]
        return self._aead.decrypt(nonce, ciphertext, aad).decode()

    def create(self, team_id: str, name: str, value: str, metadata: dict[str, str]) -> SecretRecord:
        """A new secret at version 1. Raises SecretNameTaken (nothing is stored then)."""
        now = time.time()
        record = SecretRecord(
            f"{ID_PREFIX}{uuid.uuid4().hex}", team_id, name.lower(), 1, dict(metadata), now, now
        )
        with self.catalog.transaction() as db:
            if self._row(db, team_id, record.name) is not None:
                raise SecretNameTaken(record.name)
            db.execute(
                "INSERT INTO secrets (id, team_id, name, current_version, metadata, created_at,"
                " updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    record.secret_id,
                    team_id,
                    record.name,
                    1,
                    json.dumps(record.metadata),
                    now,
                    now,
                ),
            )
            self._add_version(db, record.secret_id, 1, value, now)
        return record

    def _add_version(
        self, db: sqlite3.Connection, secret_id: str, version: int, value: str, now: float
    ) -> None:
        db.execute(
            "INSERT INTO secret_versions (secret_id, version, value, created_at)"
            " VALUES (?, ?, ?, ?)",
            (secret_id, version, self._seal(secret_id, version, value), now),
        )

    @staticmethod
    def _row(db: sqlite3.Connection, team_id: str, ref: str) -> sqlite3.Row | None:
        """The secret `ref` names: its id, or its name in any case."""
        row: sqlite3.Row | None = db.execute(
            "SELECT * FROM secrets WHERE team_id = ? AND (id = ? OR name = ?)",
            (team_id, ref, ref.lower()),
        ).fetchone()
        return row

    def get(self, team_id: str, ref: str) -> SecretRecord | None:
        row = self._row(self.catalog.db, team_id, ref)
        return _from_row(row) if row is not None else None

    def list(self, team_id: str) -> builtins.list[SecretRecord]:
        """Oldest first (a page's cursor is the last one's id)."""
        rows = self.catalog.db.execute(
            "SELECT * FROM secrets WHERE team_id = ? ORDER BY created_at, id", (team_id,)
        )
        return [_from_row(row) for row in rows]

    def update(
        self, team_id: str, ref: str, value: str, metadata: dict[str, str] | None
    ) -> SecretRecord | None:
        """Append `value` as the next version (and replace the metadata when given); None when
        `ref` names no secret."""
        now = time.time()
        with self.catalog.transaction() as db:
            row = self._row(db, team_id, ref)
            if row is None:
                return None
            record = _from_row(row)
            version = record.current_version + 1
            self._add_version(db, record.secret_id, version, value, now)
            if metadata is not None:
                record = replace(record, metadata=dict(metadata))
            db.execute(
                "UPDATE secrets SET current_version = ?, metadata = ?, updated_at = ? WHERE id = ?",
                (version, json.dumps(record.metadata), now, record.secret_id),
            )
        return replace(record, current_version=version, updated_at=now)

    def delete(self, team_id: str, ref: str) -> bool:
        """Remove the secret and every version of it; False when `ref` names none."""
        with self.catalog.transaction() as db:
            row = self._row(db, team_id, ref)
            if row is None:
                return False
            db.execute("DELETE FROM secret_versions WHERE secret_id = ?", (row["id"],))
            db.execute("DELETE FROM secrets WHERE id = ?", (row["id"],))
        return True

    def mirror(self, secrets: Sequence[tuple[SecretRecord, str]]) -> None:
        """Make the secrets exactly `secrets` (a cluster's, with their current values:
        `aenv.cluster.secrets`): those not among them go, the others are written as given
        when they changed, with their current version only."""
        wanted = {secret.secret_id: (secret, value) for secret, value in secrets}
        with self.catalog.transaction() as db:
            rows = {row["id"]: _from_row(row) for row in db.execute("SELECT * FROM secrets")}
            for secret_id in rows.keys() - wanted.keys():
                db.execute("DELETE FROM secret_versions WHERE secret_id = ?", (secret_id,))
                db.execute("DELETE FROM secrets WHERE id = ?", (secret_id,))
            for secret_id, (secret, value) in wanted.items():
                if rows.get(secret_id) != secret:
                    self._write(db, secret, value)

    def _write(self, db: sqlite3.Connection, secret: SecretRecord, value: str) -> None:
        """`secret` as given, `value` its only version."""
        db.execute(
            "INSERT OR REPLACE INTO secrets (id, team_id, name, current_version, metadata,"
            " created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                secret.secret_id,
                secret.team_id,
                secret.name,
                secret.current_version,
                json.dumps(secret.metadata),
                secret.created_at,
                secret.updated_at,
            ),
        )
        db.execute("DELETE FROM secret_versions WHERE secret_id = ?", (secret.secret_id,))
        self._add_version(db, secret.secret_id, secret.current_version, value, secret.updated_at)

    def value(self, name: str, team_id: str = TEAM_ID) -> str | None:
        """The current value of the secret named `name` (any case), read now, so an update
        takes effect on the next request; None when there is none or it does not decrypt
        (another node's key)."""
        row = self.catalog.db.execute(
            "SELECT s.id, s.current_version, v.value FROM secrets s JOIN secret_versions v"
            " ON v.secret_id = s.id AND v.version = s.current_version"
            " WHERE s.team_id = ? AND s.name = ?",
            (team_id, name.lower()),
        ).fetchone()
        if row is None:
            return None
        try:
            return self._open(row["id"], row["current_version"], row["value"])
        except InvalidTag:
            return None
