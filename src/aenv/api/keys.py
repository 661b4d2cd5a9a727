"""The node's API keys: several, each stored only as the SHA-256 of its value.

A key is `e2b_` + 40 random hex digits (160 bits), so a plain SHA-256 is a safe verifier: there
is nothing to guess that a slower hash would protect. The store (`$AENV_HOME/api-keys.json`,
0600) holds per key an id, a name, its team (`orchestrator.teams`), that digest, the mask E2B
shows (`e2b_` + the value's first two and last four characters), when it was created and when it
was last used. A request's key
is hashed and compared with every stored digest in constant time.

The first start generates a key and writes its value once to `$AENV_HOME/api-key` (0600): the
operator's copy, which `aenv auth` and the CLI read; the node itself never reads it again. A
data directory from before this store (only that file) has its key imported, hashed, at its
first start with this store, so clients keep working after the upgrade; later starts leave the
file alone, so a revoked key stays revoked. Keys are created, renamed, listed and revoked through
E2B's `/api-keys` routes (and `aenv keys`); the node's last key cannot be revoked.

The API-key gate and routes read keys through `KeyBook`, which is asynchronous so that a
cluster's gateways can keep theirs in Redis (`aenv.cluster.keys`); `LocalKeys` is this store
behind it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from aenv import atomic
from aenv.config import Paths
from aenv.ids import TEAM_ID, new_api_key

KEY_PREFIX = "e2b_"
# `last_used` is written to disk at most this often per key (seconds): not once per request.
LAST_USED_PERSIST_S = 60.0


class LastKey(ValueError):
    """Revoking this key would leave the node without one."""


def digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    id: str
    name: str
    digest: str
    value_length: int  # without the prefix, as E2B's mask counts it
    masked_prefix: str
    masked_suffix: str
    created_at: float
    last_used: float | None = None
    # The team it acts for. A store written before teams has none: its keys were the
    # default team's.
    team_id: str = TEAM_ID

    @staticmethod
    def of(value: str, name: str, team_id: str = TEAM_ID) -> ApiKey:
        bare = value.removeprefix(KEY_PREFIX)
        return ApiKey(
            id=str(uuid.uuid4()),
            name=name,
            digest=digest(value),
            value_length=len(bare),
            masked_prefix=bare[:2],
            masked_suffix=bare[-4:],
            created_at=time.time(),
            team_id=team_id,
        )


class KeyStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._keys: dict[str, ApiKey] = {}
        self._persisted_use: dict[str, float] = {}
        try:
            stored = json.loads(path.read_text())
        except FileNotFoundError:
            stored = []
        for entry in stored:
            key = ApiKey(**entry)
            self._keys[key.id] = key

    def list(self) -> list[ApiKey]:
        return sorted(self._keys.values(), key=lambda k: k.created_at)

    def get(self, key_id: str) -> ApiKey:
        """Raises KeyError for an unknown id."""
        return self._keys[key_id]

    def verify(self, given: str | None) -> ApiKey | None:
        """The stored key `given` is, or None. Every digest is compared, in constant time."""
        if not given:
            return None
        wanted = digest(given.strip()).encode()
        found = None
        for key in self._keys.values():
            if hmac.compare_digest(key.digest.encode(), wanted):
                found = key
        return self._used(found) if found is not None else None

    def create(self, name: str, team_id: str = TEAM_ID) -> tuple[ApiKey, str]:
        """A new key of `team_id` named `name`: its record and its value (shown this once,
        never stored)."""
        value = new_api_key()
        return self.add(value, name, team_id), value

    def add(self, value: str, name: str, team_id: str = TEAM_ID) -> ApiKey:
        key = ApiKey.of(value, name, team_id)
        self._keys[key.id] = key
        self._save()
        return key

    def rename(self, key_id: str, name: str) -> ApiKey:
        """Raises KeyError for an unknown id."""
        key = self._keys[key_id] = dataclasses.replace(self._keys[key_id], name=name)
        self._save()
        return key

    def revoke(self, key_id: str) -> None:
        """Raises KeyError for an unknown id, LastKey for the only one."""
        if key_id not in self._keys:
            raise KeyError(key_id)
        if len(self._keys) == 1:
            raise LastKey("cannot revoke the node's last API key: create another one first")
        del self._keys[key_id]
        self._save()

    def revoke_team(self, team_id: str) -> None:
        """Every key of `team_id` goes (its team is being deleted)."""
        self._keys = {i: k for i, k in self._keys.items() if k.team_id != team_id}
        self._save()

    def replace(self, keys: Sequence[ApiKey]) -> None:
        """Holds exactly `keys` from now on: a gateway's copy of the cluster's keys."""
        self._keys = {key.id: key for key in keys}
        self._save()

    def _used(self, key: ApiKey) -> ApiKey:
        now = time.time()
        used = self._keys[key.id] = dataclasses.replace(key, last_used=now)
        if now - self._persisted_use.get(key.id, 0.0) >= LAST_USED_PERSIST_S:
            self._persisted_use[key.id] = now
            self._save()
        return used

    def _save(self) -> None:
        entries = [dataclasses.asdict(key) for key in self.list()]
        atomic.write_text(self.path, json.dumps(entries, indent=2))


class KeyBook(Protocol):
    """Where the API-key gate and E2B's `/api-keys` routes find keys."""

    async def find(self, given: str | None) -> ApiKey | None:
        """The key `given` is, or None; records its use."""
        ...

    async def keys(self) -> list[ApiKey]:
        """Every key, oldest first."""
        ...

    async def new(self, name: str, team_id: str = TEAM_ID) -> tuple[ApiKey, str]:
        """A new key of `team_id`: its record and its value (shown this once, never
        stored)."""
        ...

    async def rename(self, key_id: str, name: str) -> ApiKey:
        """Raises KeyError for an unknown id."""
        ...

    async def revoke(self, key_id: str) -> None:
        """Raises KeyError for an unknown id, LastKey for the only one."""
        ...


class LocalKeys:
    """A node's `KeyStore` as a `KeyBook`."""

    def __init__(self, store: KeyStore) -> None:
        self.store = store

    async def find(self, given: str | None) -> ApiKey | None:
        return self.store.verify(given)

    async def keys(self) -> list[ApiKey]:
        return self.store.list()

    async def new(self, name: str, team_id: str = TEAM_ID) -> tuple[ApiKey, str]:
        return self.store.create(name, team_id)

    async def rename(self, key_id: str, name: str) -> ApiKey:
        return self.store.rename(key_id, name)

    async def revoke(self, key_id: str) -> None:
        self.store.revoke(key_id)


def open_keys(paths: Paths) -> tuple[KeyStore, bool]:
    """The node's key store, importing the key of an older node's key file (`paths.api_key`)
    when there is no store yet, or generating a first key (its value written there, 0600) when
    there is none. Returns the store and whether a key was generated."""
    # Once the store exists it alone says which keys are valid: the key file is only the
    # operator's copy, so a key revoked through the API stays revoked after a restart.
    upgrading = not paths.api_keys.exists()
    store = KeyStore(paths.api_keys)
    key_file = paths.api_key
    try:
        legacy = key_file.read_text().strip() if upgrading else ""
    except FileNotFoundError:
        legacy = ""
    if legacy:
        store.add(legacy, "default")
    if store.list():
        return store, False
    value = new_api_key()
    write_key_file(key_file, value)
    store.add(value, "default")
    return store, True


def write_key_file(path: Path, value: str) -> None:
    """The operator's copy of a generated key (mode 0600), which `aenv auth` and the CLI read."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
