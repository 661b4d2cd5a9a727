"""Dashboard sessions: a random token in an HttpOnly, SameSite=Strict cookie names the API key
it was opened with, and a CSRF token that every form and script sends back.

Sessions live in the serving process's memory: a restart signs everyone out, and no key value
is ever written to disk. The key itself is checked on every use by the API it is sent to
(`calls.py`); a key the API refuses ends the session.
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass

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


class Sessions:
    """The signed-in sessions of one serving process."""

    def __init__(self, lifetime: float = LIFETIME_S) -> None:
        self.lifetime = lifetime
        self._open: dict[str, Session] = {}

    def open(self, key: str) -> Session:
        self._drop_expired()
        session = Session(
            token=secrets.token_urlsafe(32),
            key=key,
            csrf=secrets.token_urlsafe(32),
            expires=time.time() + self.lifetime,
        )
        self._open[session.token] = session
        return session

    def find(self, token: str | None) -> Session | None:
        session = self._open.get(token) if token else None
        if session is not None and session.expires <= time.time():
            self.close(session.token)
            return None
        return session

    def close(self, token: str) -> None:
        self._open.pop(token, None)

    def _drop_expired(self) -> None:
        now = time.time()
        for token in [t for t, s in self._open.items() if s.expires <= now]:
            del self._open[token]
