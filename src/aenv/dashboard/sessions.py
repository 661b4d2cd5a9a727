"""Dashboard sessions: a random token in an HttpOnly, SameSite=Strict cookie names the API key
it was opened with, and a CSRF token that every form and script sends back.

Where sessions are kept is the server's choice (`SessionStore`). A node keeps them in its
process's memory (`MemorySessions`): a restart signs everyone out, and no key value is ever
written to disk; a node is one process, so there is no one to share them with. A gateway keeps
them in the cluster's Redis (`aenv.cluster.sessions`), so every gateway of the cluster knows
them and a restart keeps them. The key itself is checked on every use by the API it is sent to
(`calls.py`); a key the API refuses ends the session.
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Protocol

COOKIE = "aenv_session"
# A session ends this long after sign-in whatever its use: the key it holds stays usable only
# as long as a signed-in browser may be left unattended.
LIFETIME_S = 12 * 3600.0


@dataclass(frozen=True)
class Session:
    token: str
    key: str  # the API key's value: every API call of the session sends it
    csrf: str
    expires: float

    def csrf_ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given, self.csrf)

    @staticmethod
    def new(key: str, lifetime: float) -> Session:
        return Session(
            token=secrets.token_urlsafe(32),
            key=key,
            csrf=secrets.token_urlsafe(32),
            expires=time.time() + lifetime,
        )


class SessionStore(Protocol):
    """The signed-in sessions a dashboard knows."""

    lifetime: float

    async def open(self, key: str) -> Session: ...

    async def find(self, token: str | None) -> Session | None:
        """The session of `token`; None for none, or one that expired."""
        ...

    async def close(self, token: str) -> None: ...


class MemorySessions:
    """The signed-in sessions of one serving process."""

    def __init__(self, lifetime: float = LIFETIME_S) -> None:
        self.lifetime = lifetime
        self._open: dict[str, Session] = {}

    async def open(self, key: str) -> Session:
        self._drop_expired()
        session = Session.new(key, self.lifetime)
        self._open[session.token] = session
        return session

    async def find(self, token: str | None) -> Session | None:
        session = self._open.get(token) if token else None
        if session is not None and session.expires <= time.time():
            await self.close(session.token)
            return None
        return session

    async def close(self, token: str) -> None:
        self._open.pop(token, None)

    def _drop_expired(self) -> None:
        now = time.time()
        for token in [t for t, s in self._open.items() if s.expires <= now]:
            del self._open[token]
