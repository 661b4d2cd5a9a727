"""The node's signer of workload identity tokens (`identity`): JWT-SVIDs (SPIFFE's JWT
profile) under one P-256 key, and that key published for verifiers.

A token: ES256, `kid` naming the key in the JWKS, `sub` the SPIFFE id
`spiffe://<trust domain>/team/<team>/template/<template>/sandbox/<id>` (the trust domain is
the issuer's host), `aud` the one audience asked for, `iss`, `iat`, `exp` (`TOKEN_TTL_S`
later), and the three ids as claims of their own. A third party verifies it from the
issuer's OIDC discovery document (`identity.DISCOVERY_PATH`) and JWKS (`JWKS_PATH`), served by the
node and by a cluster's gateways.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from aenv.network.identity import JWKS_PATH, Subject

TOKEN_TTL_S = 300
ALGORITHM = "ES256"


def key_from_seed(seed: bytes) -> ec.EllipticCurvePrivateKey:
    """The P-256 key that `seed` (32 random bytes, or a derivation of a shared secret)
    determines: every holder of the seed signs with the same key."""
    order = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
    scalar = int.from_bytes(hashlib.sha512(seed).digest(), "big") % (order - 1) + 1
    return ec.derive_private_key(scalar, ec.SECP256R1())


def load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    """The key in `path` (PEM), made there (mode 0600) when it is missing."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        # O_EXCL: of two starts racing, one fails rather than both keeping a different key.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"workload identity key {path}: not an EC private key")
    return key


def _b64(number: int) -> str:
    return base64.urlsafe_b64encode(number.to_bytes(32, "big")).rstrip(b"=").decode()


class IdentitySigner:
    """Mints a sandbox's tokens under one key, and publishes that key."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, issuer: str) -> None:
        self._key = key
        self.issuer = issuer.rstrip("/")
        self.trust_domain = urlsplit(self.issuer).hostname or "aenv"
        numbers = key.public_key().public_numbers()
        self._jwk = {"crv": "P-256", "kty": "EC", "x": _b64(numbers.x), "y": _b64(numbers.y)}
        # RFC 7638: the thumbprint of the key's required members, in this order, names it.
        thumbprint = hashlib.sha256(json.dumps(self._jwk, separators=(",", ":")).encode())
        self.kid = base64.urlsafe_b64encode(thumbprint.digest()).rstrip(b"=").decode()

    def spiffe_id(self, subject: Subject) -> str:
        return (
            f"spiffe://{self.trust_domain}/team/{subject.team_id}"
            f"/template/{subject.template_id}/sandbox/{subject.sandbox_id}"
        )

    def token(self, subject: Subject, audience: str, now: float | None = None) -> str:
        issued = int(time.time() if now is None else now)
        claims = {
            "iss": self.issuer,
            "sub": self.spiffe_id(subject),
            "aud": audience,
            "iat": issued,
            "exp": issued + TOKEN_TTL_S,
            "sandbox_id": subject.sandbox_id,
            "team_id": subject.team_id,
            "template_id": subject.template_id,
        }
        return jwt.encode(claims, self._key, ALGORITHM, headers={"kid": self.kid, "typ": "JWT"})

    def jwks(self) -> dict[str, Any]:
        return {"keys": [{**self._jwk, "kid": self.kid, "use": "sig", "alg": ALGORITHM}]}

    def discovery(self) -> dict[str, Any]:
        """The OIDC discovery document a verifier starts from (`iss` + `DISCOVERY_PATH`)."""
        return {
            "issuer": self.issuer,
            "jwks_uri": self.issuer + JWKS_PATH,
            "response_types_supported": ["id_token"],
            "subject_types_supported": ["public"],
            "id_token_signing_alg_values_supported": [ALGORITHM],
        }
