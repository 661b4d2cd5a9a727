"""The key and issuer a node (or a cluster's gateway) signs and publishes workload identity
tokens with (`network.identity_signer`).

In a cluster every node and gateway derives the same key from the cluster secret (an HMAC
under a label of its own, as `cluster.secret` derives the others), so a token any node signed
verifies against the JWKS any of them serves, and a sandbox moved to another node keeps one
issuer; nothing more has to be shipped between machines, and Redis holds nothing of it. A
node on its own generates its key at first start (`Paths.identity_key`, 0600).
"""

from __future__ import annotations

import hashlib
import hmac

from aenv.config import Config
from aenv.network.identity_signer import IdentitySigner, key_from_seed, load_key


def issuer(config: Config) -> str:
    """`identity_issuer`, else the public domain's HTTPS origin, else this host's port."""
    if config.identity_issuer:
        return config.identity_issuer
    if config.domain:
        return f"https://{config.domain}"
    return f"http://localhost:{config.port}"


def node_signer(config: Config) -> IdentitySigner:
    """Raises ValueError for a key file that is not an EC private key."""
    if config.cluster_secret:
        label = b"aenv workload identity key"
        seed = hmac.new(config.cluster_secret.encode(), label, hashlib.sha256).digest()
        return IdentitySigner(key_from_seed(seed), issuer(config))
    return IdentitySigner(load_key(config.paths.identity_key), issuer(config))
