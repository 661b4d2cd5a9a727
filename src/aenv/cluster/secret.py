"""The cluster secret: what nodes (and, later, gateways) share to prove they belong together.

Redis keeps only its fingerprint, an HMAC of a fixed label, so reading Redis does not reveal it.
The first node to register records the fingerprint; a node with another secret is refused.
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
        digest = hmac.new(self.value.encode(), b"aenv cluster secret check", hashlib.sha256)
        return digest.hexdigest()
