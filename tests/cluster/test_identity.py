"""Workload identity in a cluster: every node and gateway derives one signing key from the
cluster secret (a node alone keeps a generated one), and a gateway publishes it, without an
API key, at the OIDC discovery and JWKS routes a verifier reads."""

from __future__ import annotations

from pathlib import Path

import httpx

from aenv.cluster.store import connect
from aenv.config import Config
from aenv.orchestrator.identity_keys import node_signer
from tests.cluster.shared import SECRET, gateway_over
from tests.proxy.support import serve
from tests.support.ports import free_port
from tests.support.redis_server import RedisServer


def test_a_clusters_members_sign_with_one_key(tmp_path: Path) -> None:
    a = node_signer(Config(home=tmp_path / "a", cluster_secret=SECRET.value, domain="aenv.test"))
    b = node_signer(Config(home=tmp_path / "b", cluster_secret=SECRET.value, domain="aenv.test"))
    assert a.kid == b.kid and a.issuer == b.issuer == "https://aenv.test"
    other = node_signer(Config(home=tmp_path / "a", cluster_secret="x" * 32))
    assert other.kid != a.kid
    alone = node_signer(Config(home=tmp_path / "c", port=3111))
    assert alone.kid != a.kid and alone.issuer == "http://localhost:3111"
    assert (tmp_path / "c" / "identity.key").stat().st_mode & 0o777 == 0o600
    assert node_signer(Config(home=tmp_path / "c")).kid == alone.kid
    given = Config(home=tmp_path / "c", identity_issuer="https://id.example.com")
    assert node_signer(given).issuer == "https://id.example.com"


async def test_a_gateway_publishes_the_clusters_keys(tmp_path: Path, redis: RedisServer) -> None:
    signer = node_signer(Config(home=tmp_path, cluster_secret=SECRET.value, domain="aenv.test"))
    client = connect(redis.url, timeout=0.5)
    gateway = gateway_over(client, identity=signer)
    with serve(gateway, free_port()) as url, httpx.Client(base_url=url) as anonymous:
        assert anonymous.get("/.well-known/jwks.json").json() == signer.jwks()
        discovery = anonymous.get("/.well-known/openid-configuration").json()
        assert discovery["jwks_uri"] == "https://aenv.test/.well-known/jwks.json"
        assert anonymous.get("/secrets").status_code == 401
    await client.aclose()
