"""A gateway dashboard's sessions (`aenv.dashboard.sessions`), in the cluster's Redis: every
gateway of the cluster finds a session another one opened, and a gateway's restart signs no one
out.

Nothing in Redis opens a session or reveals its key: a session is stored under the SHA-256 of
its cookie's token (not the token), and the API key and CSRF token it holds are sealed with the
cluster's sealing key (`aenv.cluster.sealed`), bound to that digest, so a sealed value copied to
another session's entry does not open there. The entry expires with the session; signing out
or a key the API refuses deletes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from aenv.api.errors import APIError
from aenv.cluster.sealed import Sealer, Unsealable
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.store import ClusterUnavailable, Keys, guarded
from aenv.dashboard.sessions import LIFETIME_S, Session


class RedisSessions:
    """`aenv.dashboard.sessions.SessionStore` in Redis (see the module docstring). Redis not
    answering is a 503 for the page asking."""

    def __init__(
        self,
        client: aioredis.Redis,
        secret: ClusterSecret,
        keys: Keys | None = None,
        lifetime: float = LIFETIME_S,
    ) -> None:
        self.client = client
        self.keys = keys or Keys()
        self.lifetime = lifetime
        self._sealer = Sealer(secret)

    async def open(self, key: str) -> Session:
        session = Session.new(key, self.lifetime)
        digest = _digest(session.token)
        context = _context(digest)
        entry = {
            "key": self._sealer.seal(session.key, context),
            "csrf": self._sealer.seal(session.csrf, context),
            "expires": session.expires,
        }
        async with _guarded(self.client, "opening a dashboard session"):
            await self.client.set(
                self.keys.dashboard_session(digest),
                json.dumps(entry),
                exat=math.ceil(session.expires),
            )
        return session

    async def find(self, token: str | None) -> Session | None:
        if not token:
            return None
        digest = _digest(token)
        async with _guarded(self.client, "reading a dashboard session"):
            raw = await self.client.get(self.keys.dashboard_session(digest))
        if raw is None:
            return None
        try:
            entry = json.loads(raw)
            context = _context(digest)
            key = self._sealer.open(entry["key"], context)
            csrf = self._sealer.open(entry["csrf"], context)
            expires = float(entry["expires"])
        except (ValueError, KeyError, TypeError, Unsealable):
            return None  # not one this cluster sealed for this token: no session
        return Session(token, key, csrf, expires)

    async def close(self, token: str) -> None:
        async with _guarded(self.client, "closing a dashboard session"):
            await self.client.delete(self.keys.dashboard_session(_digest(token)))


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _context(digest: str) -> str:
    return f"dashboard session {digest}"


@contextlib.asynccontextmanager
async def _guarded(client: aioredis.Redis, doing: str) -> AsyncIterator[None]:
    """`guarded`, with Redis not answering as the API's 503, which the dashboard's pages answer
    as JSON."""
    try:
        async with guarded(client, doing):
            yield
    except ClusterUnavailable as error:
        raise APIError(503, f"the cluster is unavailable: {error}") from error
