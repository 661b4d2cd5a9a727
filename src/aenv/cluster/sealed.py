"""What the cluster keeps in Redis that must not be read there: sealed with AES-256-GCM under a
key derived from the cluster secret (`ClusterSecret.sealing_key`).

Why that key and not one more file the operator provides: the parties that seal and open
(gateways, nodes) are exactly those that hold the cluster secret already, and Redis holds only
HMACs of it under other labels (its fingerprint, the internal bearer token), so a reader of
Redis gets no key. A separate key would be a second secret to copy to every node and gateway in
lockstep, and one that differed on a node would fail only when that node opened something. The
protection is as strong as the cluster secret: make it random (`openssl rand -hex 32`,
docs/cluster.md).

Each sealed value is bound to where it belongs (`context`: a secret's id and version, a
sandbox's id), so a value copied to another key or field does not open there.
"""

from __future__ import annotations

import base64
import binascii
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from aenv.cluster.secret import ClusterSecret

# The prefix of a sealed value: a format version, so a later one can be told apart.
PREFIX = "sealed1:"
_NONCE_BYTES = 12


class Unsealable(ValueError):
    """A value that is not sealed, or not under this cluster's key for this context."""


class Sealer:
    def __init__(self, secret: ClusterSecret) -> None:
        self._aead = AESGCM(secret.sealing_key)

    def seal(self, plain: str, context: str) -> str:
        nonce = os.urandom(_NONCE_BYTES)
        sealed = nonce + self._aead.encrypt(nonce, plain.encode(), context.encode())
        return PREFIX + base64.b64encode(sealed).decode()

    def open(self, sealed: str, context: str) -> str:
        """The plain text of `sealed`; raises `Unsealable` (its message names no value)."""
        if not sealed.startswith(PREFIX):
            raise Unsealable(f"{context}: not a sealed value")
        try:
            raw = base64.b64decode(sealed[len(PREFIX) :], validate=True)
            nonce, ciphertext = raw[:_NONCE_BYTES], raw[_NONCE_BYTES:]
            return self._aead.decrypt(nonce, ciphertext, context.encode()).decode()
        except (binascii.Error, InvalidTag, UnicodeDecodeError) as e:
            raise Unsealable(f"{context}: does not open under this cluster's key") from e
