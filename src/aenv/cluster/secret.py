"""The cluster secret: what nodes and gateways share to prove they belong together.

Redis keeps only its fingerprint, an HMAC of a fixed label, so reading Redis does not reveal it.
The first node to register records the fingerprint; a node with another secret is refused.
Gateways call a node's internal API with a bearer token, another HMAC of the secret under its own
label, so the token and the fingerprint reveal neither the secret nor each other. What the
cluster keeps sealed in Redis (`aenv.cluster.sealed`) is under a third derivation, its
`sealing_key`; the operator's admin token (`admin_token`) under a fourth.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

MIN_LENGTH = 16


class WeakSecret(ValueError):
    """A cluster secret too short to resist guessing."""


@dataclass(frozen=True)
class ClusterSecret:
    value: str = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.value) < MIN_LENGTH:
            raise WeakSecret(f"the cluster secret must be at least {MIN_LENGTH} characters")

    @property
    def fingerprint(self) -> str:
        return self._derive(b"aenv cluster secret check")

    @property
    def bearer(self) -> str:
        """The token gateways present to nodes' internal API (`aenv.cluster.internal`)."""
        return self._derive(b"aenv internal api bearer")

    @property
    def admin_token(self) -> str:
        """The cluster's operator credential: the `X-Admin-Token` its gateways' admin routes
        take (`aenv.gateway.admin`). Whoever holds the secret can derive it; a gateway writes
        it into its home's `admin-token` for `aenv teams` and `aenv keys create --team`."""
        return "aenv_admin_" + self._derive(b"aenv cluster admin token")

    @property
    def sealing_key(self) -> bytes:
        """The AES-256 key of what the cluster seals in Redis (`aenv.cluster.sealed`)."""
        return hmac.new(self.value.encode(), b"aenv cluster sealing key", hashlib.sha256).digest()

    def _derive(self, label: bytes) -> str:
        return hmac.new(self.value.encode(), label, hashlib.sha256).hexdigest()
