"""A cluster's secrets (E2B's `/secrets`), in Redis: written through any gateway, mirrored by
every node, whose egress proxies fill them into header rules.

Each secret is one field of a hash (`Keys.secrets`: id -> its record as JSON, with its current
value sealed under the cluster's key, `aenv.cluster.sealed`, bound to the secret's id and
version), and its team and name one field of another (`Keys.secret_names`), which makes a name
unique in its team. Only the current value is kept: no route answers an old one, and the
egress proxy sends the current one.

Every node's agent mirrors the whole set into its catalog at each heartbeat
(`StateSource.mirror_secrets`, `SecretStore.mirror`), sealed there under the node's own key:
a create, update or delete reaches every node's egress proxies within a heartbeat, and a node
keeps sending the values it last mirrored while Redis is down. A sandbox moved to another
node resolves its rules' markers there, from the same set. Like the webhooks, the set is one
the nodes cannot rebuild: a Redis wiped without persistence loses it.
"""

from __future__ import annotations

import builtins
import json
import logging
import time
import uuid
from collections.abc import Awaitable
from dataclasses import asdict, replace
from typing import cast

import redis.asyncio as aioredis

from aenv.cluster.sealed import Sealer, Unsealable
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.store import Keys, guarded
from aenv.orchestrator.secrets import ID_PREFIX, SecretNameTaken, SecretRecord

# KEYS: the secrets hash, the names hash. ARGV: team/name, id, record. 0 when the name is taken.
_CREATE = """
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
return 1
"""

# KEYS: the secrets hash. ARGV: id, the record read, the new one. 0 when it changed meanwhile.
_REPLACE = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""

# KEYS: the secrets hash, the names hash. ARGV: id, the record read, team/name.
_DELETE = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
if redis.call('HGET', KEYS[2], ARGV[3]) == ARGV[1] then redis.call('HDEL', KEYS[2], ARGV[3]) end
return 1
"""

log = logging.getLogger("aenv.cluster")

# Writes that lost a race with another gateway's are tried again this many times.
_TRIES = 8


def _context(secret_id: str, version: int) -> str:
    return f"secret {secret_id}/{version}"


def _name_key(team_id: str, name: str) -> str:
    return f"{team_id}/{name.lower()}"


class ConflictingWrites(RuntimeError):
    """Other writes to a secret kept winning over this one: nothing of it was stored."""


class ClusterSecrets:
    def __init__(
        self, client: aioredis.Redis, secret: ClusterSecret, keys: Keys | None = None
    ) -> None:
        self.client = client
        self.keys = keys or Keys()
        self._sealer = Sealer(secret)
        self._create = client.register_script(_CREATE)
        self._replace = client.register_script(_REPLACE)
        self._delete = client.register_script(_DELETE)

    def _record(self, secret: SecretRecord, value: str) -> str:
        sealed = self._sealer.seal(value, _context(secret.secret_id, secret.current_version))
        return json.dumps({**asdict(secret), "sealed": sealed})

    @staticmethod
    def _secret(record: str) -> SecretRecord:
        fields = json.loads(record)
        fields.pop("sealed")
        return SecretRecord(**fields)

    def _value(self, record: str) -> str:
        secret = self._secret(record)
        sealed = json.loads(record)["sealed"]
        return self._sealer.open(sealed, _context(secret.secret_id, secret.current_version))

    async def create(
        self, team_id: str, name: str, value: str, metadata: dict[str, str]
    ) -> SecretRecord:
        """A new secret at version 1. Raises SecretNameTaken (nothing is stored then)."""
        now = time.time()
        secret = SecretRecord(
            f"{ID_PREFIX}{uuid.uuid4().hex}", team_id, name.lower(), 1, dict(metadata), now, now
        )
        keys = [self.keys.secrets, self.keys.secret_names]
        args = [_name_key(team_id, name), secret.secret_id, self._record(secret, value)]
        async with guarded(self.client, f"creating secret {secret.name}"):
            created = await self._create(keys, args)
        if not created:
            raise SecretNameTaken(secret.name)
        return secret

    async def _read(self, team_id: str, ref: str) -> str | None:
        """The record of the secret `ref` names in the team (its id, or its name in any
        case)."""
        async with guarded(self.client, f"reading secret {ref}"):
            secret_id: str | None = ref
            if not ref.startswith(ID_PREFIX):
                secret_id = await self._hget(self.keys.secret_names, _name_key(team_id, ref))
            if secret_id is None:
                return None
            record = await self._hget(self.keys.secrets, secret_id)
        if record is None or self._secret(record).team_id != team_id:
            return None
        return record

    async def _hget(self, key: str, field: str) -> str | None:
        return await cast("Awaitable[str | None]", self.client.hget(key, field))

    async def get(self, team_id: str, ref: str) -> SecretRecord | None:
        record = await self._read(team_id, ref)
        return None if record is None else self._secret(record)

    async def list(self, team_id: str) -> builtins.list[SecretRecord]:
        """The team's secrets, oldest first (a page's cursor is the last one's id)."""
        found = [s for s in await self._all() if s.team_id == team_id]
        return sorted(found, key=lambda s: (s.created_at, s.secret_id))

    async def _all(self) -> builtins.list[SecretRecord]:
        return [self._secret(r) for r in (await self._records()).values()]

    async def _records(self) -> dict[str, str]:
        async with guarded(self.client, "reading the secrets"):
            return cast("dict[str, str]", await self.client.hgetall(self.keys.secrets))

    async def update(
        self, team_id: str, ref: str, value: str, metadata: dict[str, str] | None
    ) -> SecretRecord | None:
        """`value` as the next version (and the metadata replaced when given); None when `ref`
        names no secret. Of two updates at once, each gets a version of its own."""
        for _ in range(_TRIES):
            record = await self._read(team_id, ref)
            if record is None:
                return None
            secret = self._secret(record)
            changed = replace(
                secret,
                current_version=secret.current_version + 1,
                metadata=secret.metadata if metadata is None else dict(metadata),
                updated_at=time.time(),
            )
            args = [secret.secret_id, record, self._record(changed, value)]
            async with guarded(self.client, f"updating secret {secret.name}"):
                if await self._replace([self.keys.secrets], args):
                    return changed
        raise ConflictingWrites(f"secret '{ref}' changed {_TRIES} times while being updated")

    async def delete(self, team_id: str, ref: str) -> bool:
        """Remove the secret; False when `ref` names none."""
        for _ in range(_TRIES):
            record = await self._read(team_id, ref)
            if record is None:
                return False
            secret = self._secret(record)
            keys = [self.keys.secrets, self.keys.secret_names]
            args = [secret.secret_id, record, _name_key(secret.team_id, secret.name)]
            async with guarded(self.client, f"deleting secret {secret.name}"):
                if await self._delete(keys, args):
                    return True
        raise ConflictingWrites(f"secret '{ref}' changed {_TRIES} times while being deleted")

    async def current(self) -> builtins.list[tuple[SecretRecord, str]]:
        """Every team's secrets with their current values, for a node's mirror. One whose
        value does not open (sealed under another cluster secret) is left out, logged: no
        node could send it."""
        found = []
        for record in (await self._records()).values():
            try:
                found.append((self._secret(record), self._value(record)))
            except Unsealable as error:
                log.warning("secret left out of the mirror: %s", error)
        return found
