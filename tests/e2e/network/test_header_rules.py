"""Header rules (`network.rules`) with the unmodified SDK against a real VM: curl and Python in
the guest reach the simulated internet's HTTPS server (tests/e2e/internet.py, `/headers` echoes
what it got), a ruled name with the rule's header, another name without it; the info shows the
value `REDACTED`; an update gives a running sandbox its first rules, kept across pause and
resume; a rule naming a secret (`Secret.fill`) sends the secret's current value, which the guest
never holds; a rule naming a workload identity token (`iam`, `ctx.iam.tokens[...]`) sends a
JWT-SVID that verifies against the node's published JWKS for its audience alone."""

from __future__ import annotations

import json

import httpx
import jwt
import pytest
from e2b import Sandbox, Secret
from e2b.sandbox.sandbox_api import SandboxIamOpts, SandboxNetworkOpts, SandboxNetworkRule

from tests.e2e.network.conftest import API

SECRET = "s3cret-e2e"
RULED: SandboxNetworkOpts = {
    "allow_out": ["allowed.test", "other.test"],
    "deny_out": ["0.0.0.0/0"],
    "rules": {"allowed.test": [{"transform": {"headers": {"X-Api-Key": SECRET}}}]},
}
PYTHON = (
    "import urllib.request; "
    "print(urllib.request.urlopen('https://allowed.test/headers', timeout=20).read().decode())"
)


def _headers(sandbox: Sandbox, command: str) -> dict[str, str]:
    result = sandbox.commands.run(command, timeout=60)
    return {name.lower(): value for name, value in json.loads(result.stdout)}


def test_headers_reach_the_ruled_name_only() -> None:
    sandbox = Sandbox.create(timeout=180, network=RULED)
    try:
        # The guest trusts the node's egress CA (its system bundle and SSL_CERT_FILE).
        got = _headers(sandbox, "curl -sS -m 20 -H 'X-Api-Key: guest' https://allowed.test/headers")
        assert got["x-api-key"] == SECRET
        assert _headers(sandbox, f'python3 -c "{PYTHON}"')["x-api-key"] == SECRET
        # Another name passes through untouched (its own certificate: the test CA, which the
        # guest does not trust, hence -k).
        assert "x-api-key" not in _headers(sandbox, "curl -sS -m 20 -k https://other.test/headers")
        info = sandbox.get_info().network
        assert info is not None
        assert info["rules"] == {
            "allowed.test": [{"transform": {"headers": {"X-Api-Key": "REDACTED"}}}]
        }
    finally:
        sandbox.kill()


def test_an_update_gives_a_running_sandbox_rules() -> None:
    plain: SandboxNetworkOpts = {"allow_out": ["allowed.test"], "deny_out": ["0.0.0.0/0"]}
    sandbox = Sandbox.create(timeout=180, network=plain)
    try:
        assert "x-api-key" not in _headers(
            sandbox, "curl -sS -m 20 -k https://allowed.test/headers"
        )
        rules: dict[str, list[SandboxNetworkRule]] = {
            "allowed.test": [{"transform": {"headers": {"X-Api-Key": SECRET}}}]
        }
        sandbox.update_network(
            {"allow_out": ["allowed.test"], "deny_out": ["0.0.0.0/0"], "rules": rules}
        )
        got = _headers(sandbox, "curl -sS -m 20 https://allowed.test/headers")
        assert got["x-api-key"] == SECRET
        # Kept across pause and resume; the guest trusts the CA the node installs again.
        assert sandbox.pause() is True
        sandbox = Sandbox.connect(sandbox.sandbox_id, timeout=180)
        got = _headers(sandbox, "curl -sS -m 20 --http1.1 https://allowed.test/headers")
        assert got["x-api-key"] == SECRET
    finally:
        sandbox.kill()


def test_a_rule_sends_a_secret_the_guest_never_holds() -> None:
    name = "e2e-api-key"
    Secret.create(name, "v1-" + SECRET)
    network: SandboxNetworkOpts = {
        "allow_out": ["allowed.test", "other.test"],
        "deny_out": ["0.0.0.0/0"],
        "rules": {"allowed.test": [{"transform": {"headers": {"X-Api-Key": Secret.fill(name)}}}]},
    }
    sandbox = Sandbox.create(timeout=180, network=network)
    try:
        curl = "curl -sS -m 20 https://allowed.test/headers"
        assert _headers(sandbox, curl)["x-api-key"] == "v1-" + SECRET
        Secret.update(name, "v2-" + SECRET)
        assert _headers(sandbox, curl)["x-api-key"] == "v2-" + SECRET
        # Nowhere in the guest: its environment, its files, its processes.
        search = sandbox.commands.run(
            f"grep -rs -l {SECRET} /etc /root /tmp /proc/[0-9]*/environ;"
            f" env | grep -c {SECRET} || true",
            timeout=60,
        )
        assert search.stdout.strip() == "0", search.stdout
        info = sandbox.get_info().network
        assert info is not None
        assert info["rules"] == {
            "allowed.test": [{"transform": {"headers": {"X-Api-Key": Secret.fill(name)}}}]
        }
    finally:
        sandbox.kill()
        Secret.destroy(name)


def test_a_rule_sends_a_workload_token_that_verifies_for_its_audience() -> None:
    iam: SandboxIamOpts = {
        "tokens": {"aws": Secret.iam_token(audience="sts.example.test", token_type="JWT-SVID")}
    }
    network: SandboxNetworkOpts = {
        "allow_out": ["allowed.test"],
        "deny_out": ["0.0.0.0/0"],
        "rules": {
            "allowed.test": [
                {
                    "transform": lambda ctx: {
                        "headers": {"Authorization": f"Bearer {ctx.iam.tokens['aws']}"}
                    }
                }
            ]
        },
    }
    sandbox = Sandbox.create(timeout=180, network=network, iam=iam)
    try:
        got = _headers(sandbox, "curl -sS -m 20 https://allowed.test/headers")
        token = got["authorization"].removeprefix("Bearer ")
        discovery = httpx.get(f"{API}/.well-known/openid-configuration", timeout=30).json()
        jwks = httpx.get(f"{API}/.well-known/jwks.json", timeout=30).json()
        kid = jwt.get_unverified_header(token)["kid"]
        [key] = [k for k in jwt.PyJWKSet.from_dict(jwks).keys if k.key_id == kid]
        claims = jwt.decode(
            token,
            key,
            algorithms=["ES256"],
            audience="sts.example.test",
            issuer=discovery["issuer"],
        )
        assert claims["sandbox_id"] == sandbox.sandbox_id
        assert claims["sub"].endswith(f"/sandbox/{sandbox.sandbox_id}")
        with pytest.raises(jwt.InvalidAudienceError):
            jwt.decode(token, key, algorithms=["ES256"], audience="another.test")
        info = sandbox.get_info().network
        assert info is not None
        assert info["rules"] == {
            "allowed.test": [{"transform": {"headers": {"Authorization": "REDACTED"}}}]
        }
    finally:
        sandbox.kill()
