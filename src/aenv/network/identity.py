"""Workload identity (E2B's `iam`): short-lived JWT-SVIDs that name a sandbox, its team and
its template, one per audience its `iam.tokens` define, signed by the node and filled in by
the slot's egress proxy where a header rule names the token.

What E2B's SDK does, and so what a guest gets here: `iam={"tokens": {"aws":
Secret.iam_token(audience=..., token_type="JWT-SVID")}}` at create, and a header rule whose
value holds the placeholder the SDK's `ctx.iam.tokens["aws"]` writes,
`${e2b.identity.tokens.aws}`, "which the egress proxy resolves per request". A token is
therefore never in the guest, like a secret's value: the guest asks for a request to be sent
with it, and only the rule's domain receives it. Each request gets a token minted then, valid
for a few minutes (`identity_signer.TOKEN_TTL_S`). A rule naming a token the sandbox's `iam`
does not define sends nothing.

The tokens are JWT-SVIDs, signed by `identity_signer`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

# What the SDK's `ctx.iam.tokens[name]` is on the wire (it refuses names with braces or
# control characters).
IDENTITY_MARKER = re.compile(r"\$\{e2b\.identity\.tokens\.([^{}]*)\}")
TOKEN_TYPE = "JWT-SVID"  # noqa: S105 - a token's type, not a credential: E2B's only one
MAX_TOKENS = 5  # E2B's limit
MAX_AUDIENCE = 1024
# Where a node and a cluster's gateways publish the signing keys (OIDC discovery, then JWKS).
DISCOVERY_PATH = "/.well-known/openid-configuration"
JWKS_PATH = "/.well-known/jwks.json"
_NAME = re.compile(r"[^{}\x00-\x1f\x7f-\x9f]+")


@dataclass(frozen=True)
class IdentityTokens:
    """A sandbox's `iam.tokens`: (name, audience) in the order given. Raises ValueError for
    more than `MAX_TOKENS`, a name the placeholder cannot carry, or an empty audience."""

    tokens: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if len(self.tokens) > MAX_TOKENS:
            raise ValueError(f"at most {MAX_TOKENS} tokens")
        for name, audience in self.tokens:
            if not _NAME.fullmatch(name):
                raise ValueError(f"token name {name!r}: not empty, no braces or controls")
            if not audience or len(audience) > MAX_AUDIENCE:
                raise ValueError(f"token {name!r}: an audience of 1 to {MAX_AUDIENCE} characters")

    def audience(self, name: str) -> str | None:
        return dict(self.tokens).get(name)

    def to_json(self) -> dict[str, Any]:
        """As E2B's create body has it (`iam`)."""
        return {"tokens": {n: {"audience": a, "tokenType": TOKEN_TYPE} for n, a in self.tokens}}


NO_TOKENS = IdentityTokens()


@dataclass(frozen=True)
class Subject:
    """Who a sandbox's tokens say it is."""

    sandbox_id: str
    team_id: str
    template_id: str


@dataclass(frozen=True)
class WorkloadIdentity:
    """What a slot's egress proxy needs to fill a sandbox's tokens in."""

    subject: Subject
    tokens: IdentityTokens


class Signer(Protocol):
    """Who mints a sandbox's tokens and publishes the keys they verify with
    (`identity_signer.IdentitySigner`)."""

    issuer: str

    def token(self, subject: Subject, audience: str) -> str: ...

    def jwks(self) -> dict[str, Any]: ...

    def discovery(self) -> dict[str, Any]: ...
