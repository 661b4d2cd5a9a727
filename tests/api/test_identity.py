"""Workload identity (E2B's `iam`) through the control plane over a node on doubles: the create
field taken, its tokens reaching the slot's policy with each sandbox's own subject (a fork's
names the fork), kept across pause and resume and network updates, rules naming tokens it does
not define refused, and the OIDC discovery document and JWKS served without an API key."""

from __future__ import annotations

from pathlib import Path

import httpx
import jwt

from aenv.ids import TEAM_ID
from aenv.network.identity import IdentityTokens, Subject, WorkloadIdentity
from aenv.network.identity_signer import IdentitySigner, key_from_seed
from tests.api.test_network import create, slot_of
from tests.api.test_routes import error, served
from tests.doubles.node import double_node

TOKEN = "${e2b.identity.tokens.aws}"
IAM = {"tokens": {"aws": {"audience": "sts.example.com", "tokenType": "JWT-SVID"}}}
RULED = {
    "allowOut": ["api.example.com"],
    "denyOut": ["0.0.0.0/0"],
    "rules": {"api.example.com": [{"transform": {"headers": {"Authorization": TOKEN}}}]},
}
ISSUER = "https://aenv.example.com"


async def test_iam_tokens_reach_the_slot_with_each_sandboxs_subject(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        node.orchestrator.signer = IdentitySigner(key_from_seed(b"k"), ISSUER)
        async with served(node) as api:
            sandbox_id = await create(api, network=RULED, iam=IAM)
            tokens = IdentityTokens((("aws", "sts.example.com"),))
            _, policy = slot_of(node, sandbox_id)
            assert policy.identity == WorkloadIdentity(Subject(sandbox_id, TEAM_ID, "base"), tokens)
            info = (await api.get(f"/sandboxes/{sandbox_id}")).json()["network"]
            assert info["rules"] == {
                "api.example.com": [{"transform": {"headers": {"Authorization": TOKEN}}}]
            }
            assert (await api.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
            resumed = await api.post(f"/sandboxes/{sandbox_id}/connect", json={})
            assert resumed.status_code == 201
            assert slot_of(node, sandbox_id)[1] == policy
            forked = await api.post(f"/sandboxes/{sandbox_id}/fork", json={"count": 1})
            child = forked.json()[0]["sandbox"]["sandboxID"]
            assert slot_of(node, child)[1].identity == WorkloadIdentity(
                Subject(child, TEAM_ID, "base"), tokens
            )
            # A network update keeps the tokens, and may name them; not one it lacks.
            url = f"/sandboxes/{sandbox_id}/network"
            assert (await api.put(url, json=RULED)).status_code == 204
            assert slot_of(node, sandbox_id)[1] == policy
            other = {
                "api.example.com": [{"transform": {"headers": {"X": "${e2b.identity.tokens.gcp}"}}}]
            }
            refused = await api.put(url, json={**RULED, "rules": other})
            assert "names workload token 'gcp', which iam does not define" in error(refused, 400)
            assert slot_of(node, sandbox_id)[1] == policy


async def test_what_iam_cannot_honour_is_refused(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        cases = [
            ({"tokens": {"aws": {"audience": "a", "tokenType": "OIDC"}}}, "tokenType"),
            ({"tokens": {"aws": {"audience": "a"}}}, "tokenType"),
            ({"tokens": {"aws": {"audience": "", "tokenType": "JWT-SVID"}}}, "audience"),
            ({"tokens": {f"t{i}": IAM["tokens"]["aws"] for i in range(6)}}, "at most 5"),
            ({"tokens": {"a}b": IAM["tokens"]["aws"]}}, "no braces"),
            ({"roles": []}, "roles"),
        ]
        for iam, named in cases:
            refused = await api.post("/sandboxes", json={"templateID": "base", "iam": iam})
            assert named in error(refused, 400), iam
        # A rule naming a token without the iam to define it.
        refused = await api.post("/sandboxes", json={"templateID": "base", "network": RULED})
        assert "workload token 'aws'" in error(refused, 400)
        # An empty tokens map is workload identity off, as in E2B.
        await create(api, iam={"tokens": {}})
        # An update's body is judged before its sandbox is looked up.
        unknown = f"/sandboxes/{'x' * 20}/network"
        assert "denyOut" in error(await api.put(unknown, json={"denyOut": ["a.test"]}), 400)
        assert (await api.put(unknown, json={"denyOut": ["0.0.0.0/0"]})).status_code == 404


async def test_discovery_and_jwks_are_served_without_a_key(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        signer = IdentitySigner(key_from_seed(b"k"), ISSUER)
        node.orchestrator.signer = signer
        async with served(node) as api:
            anonymous = httpx.AsyncClient(base_url=str(api.base_url))
            async with anonymous:
                discovery = (await anonymous.get("/.well-known/openid-configuration")).json()
                assert discovery["issuer"] == ISSUER
                assert discovery["jwks_uri"] == ISSUER + "/.well-known/jwks.json"
                jwks = (await anonymous.get("/.well-known/jwks.json")).json()
                assert (await anonymous.get("/sandboxes")).status_code == 401
        [key] = jwt.PyJWKSet.from_dict(jwks).keys
        token = signer.token(Subject("s", TEAM_ID, "base"), "aud")
        assert jwt.decode(token, key, algorithms=["ES256"], audience="aud")["sub"].endswith("/s")
