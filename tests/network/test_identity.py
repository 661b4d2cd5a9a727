"""Workload identity tokens (`network.identity`, `network.identity_signer`): what a sandbox's
`iam` may define, the JWT-SVIDs a verifier checks with nothing but the published JWKS (PyJWT,
as a third party would), the keys a node generates or a cluster derives, and the markers the
egress proxy fills in."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import jwt
import pytest

from aenv.ids import TEAM_ID
from aenv.network.header_rules import SecretUnavailable, resolve, shown
from aenv.network.identity import IdentityTokens, Subject, WorkloadIdentity
from aenv.network.identity_signer import TOKEN_TTL_S, IdentitySigner, key_from_seed, load_key
from aenv.network.settings import SandboxNetwork

SUBJECT = Subject("sbx0123456789abcdefgh", "team-1", "base")
ISSUER = "https://aenv.example.com"


def verify(token: str, jwks: dict[str, object], audience: str) -> dict[str, object]:
    """What a third party does: the key the token's `kid` names in the JWKS, then ES256 and
    the audience it is (the issuer it expects)."""
    kid = jwt.get_unverified_header(token)["kid"]
    keys = jwt.PyJWKSet.from_dict(jwks)
    key = next(k for k in keys.keys if k.key_id == kid)
    claims: dict[str, object] = jwt.decode(
        token, key, algorithms=["ES256"], audience=audience, issuer=ISSUER
    )
    return claims


def test_a_token_verifies_against_the_jwks_for_its_audience_only() -> None:
    signer = IdentitySigner(key_from_seed(b"seed"), ISSUER + "/")
    jwks = json.loads(json.dumps(signer.jwks()))  # as it travels
    token = signer.token(SUBJECT, "sts.amazonaws.com")
    claims = verify(token, jwks, "sts.amazonaws.com")
    assert claims["sub"] == "spiffe://aenv.example.com/team/team-1/template/base/sandbox/" + (
        SUBJECT.sandbox_id
    )
    assert claims["sandbox_id"] == SUBJECT.sandbox_id and claims["team_id"] == "team-1"
    assert claims["template_id"] == "base"
    issued = claims["iat"]
    assert isinstance(issued, int) and claims["exp"] == issued + TOKEN_TTL_S
    with pytest.raises(jwt.InvalidAudienceError):
        verify(token, jwks, "another.example.com")
    # Expired: refused.
    old = signer.token(SUBJECT, "sts.amazonaws.com", now=1_000_000)
    with pytest.raises(jwt.ExpiredSignatureError):
        verify(old, jwks, "sts.amazonaws.com")
    # Another key's token: its kid is not in this JWKS, nor does it verify under this key.
    other = IdentitySigner(key_from_seed(b"other"), ISSUER).token(SUBJECT, "sts.amazonaws.com")
    with pytest.raises(StopIteration):
        verify(other, jwks, "sts.amazonaws.com")
    discovery = signer.discovery()
    assert discovery["issuer"] == ISSUER
    assert discovery["jwks_uri"] == ISSUER + "/.well-known/jwks.json"


def test_keys_from_one_seed_are_one_key_and_a_node_keeps_its_own(tmp_path: Path) -> None:
    assert IdentitySigner(key_from_seed(b"s"), ISSUER).kid == (
        IdentitySigner(key_from_seed(b"s"), ISSUER).kid
    )
    assert IdentitySigner(key_from_seed(b"s"), ISSUER).kid != (
        IdentitySigner(key_from_seed(b"t"), ISSUER).kid
    )
    path = tmp_path / "identity.key"
    first = IdentitySigner(load_key(path), ISSUER)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert IdentitySigner(load_key(path), ISSUER).kid == first.kid
    path.write_text("not a key")
    with pytest.raises(ValueError):
        load_key(path)


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        (tuple((f"t{i}", "aud") for i in range(6)), "at most 5 tokens"),
        ((("", "aud"),), "token name ''"),
        ((("a}b", "aud"),), "no braces"),
        ((("a\x85", "aud"),), "no braces or controls"),
        ((("aws", ""),), "an audience of 1 to"),
    ],
)
def test_iam_refuses_what_the_sdk_refuses(
    tokens: tuple[tuple[str, str], ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        IdentityTokens(tokens)


def test_a_rule_may_name_only_tokens_iam_defines() -> None:
    rule = {
        "domain": "api.test",
        "headers": [["Authorization", "Bearer ${e2b.identity.tokens.aws}"]],
    }
    data = {"allow_out": ["api.test"], "deny_out": ["0.0.0.0/0"], "rules": [rule]}
    with pytest.raises(ValueError, match="names workload token 'aws', which iam does not define"):
        SandboxNetwork.from_json(data)
    network = SandboxNetwork.from_json({**data, "iam": [["aws", "sts.test"]]})
    assert network.iam.audience("aws") == "sts.test"
    assert SandboxNetwork.from_json(network.to_json()) == network
    assert shown("${e2b.identity.tokens.aws}") == "${e2b.identity.tokens.aws}"
    assert shown("Bearer ${e2b.identity.tokens.aws}") == "REDACTED"


def test_markers_are_filled_with_a_token_minted_per_request() -> None:
    signer = IdentitySigner(key_from_seed(b"seed"), ISSUER)
    identity = WorkloadIdentity(SUBJECT, IdentityTokens((("aws", "sts.test"),)))

    def token(name: str) -> str | None:
        audience = identity.tokens.audience(name)
        return None if audience is None else signer.token(identity.subject, audience)

    [(name, value)] = resolve(
        (("Authorization", "Bearer ${e2b.identity.tokens.aws}"),), None, token, team_id=TEAM_ID
    )
    assert name == "Authorization" and value.startswith("Bearer ")
    assert verify(value.removeprefix("Bearer "), signer.jwks(), "sts.test")["aud"] == "sts.test"
    with pytest.raises(SecretUnavailable, match="workload token 'gcp' is not in the sandbox"):
        resolve((("X", "${e2b.identity.tokens.gcp}"),), None, token, team_id=TEAM_ID)
    with pytest.raises(SecretUnavailable, match="workload token 'aws'"):
        # No signer on this node.
        resolve((("X", "${e2b.identity.tokens.aws}"),), None, team_id=TEAM_ID)
