"""A sandbox's header rules (E2B's `network.rules`): per domain, the request headers its egress
proxy sets on HTTPS requests to that domain.

A rule's domain is a name or a `*.` wildcard, as in `allowOut` (`domains`). A request gets the
headers of every rule that matches the name its connection asked for (TLS SNI): wildcards first,
then the exact name, each in the order given, so the more specific rule wins a header both set.
A header a rule sets replaces any of the same name the request has (E2B: "inject or override").

Names that frame or route a request (`Content-Length`, `Host`, ...) are refused: setting them
would let a rule change what a request is, not what it says.

A value may name secrets (E2B's `Secret.fill`: `${e2b.secrets.<name>}`); the egress proxy
replaces each marker by the secret's value when it sends a request (`resolve`), read at that
moment, so the guest and the sandbox's settings only ever hold the marker. A request whose
rule names a secret that does not exist (or no longer does) is not sent. A value may name the
sandbox's workload identity tokens alike (`${e2b.identity.tokens.<name>}`, `identity`), each
minted as the request is sent.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from aenv.network.domains import DomainRules, normalise
from aenv.network.identity import IDENTITY_MARKER

# RFC 9110 token and field-value (no control characters but tab, no leading/trailing space).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
HEADER_VALUE = re.compile(r"[\x21-\x7e\x80-\xff]([\x20-\x7e\x80-\xff\t]*[\x21-\x7e\x80-\xff])?|")
FRAMING = frozenset(
    {
        "connection",
        "content-length",
        "host",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
MAX_HEADERS = 64
# What is shown of a rule's header value anywhere but the egress proxy: values are credentials.
REDACTED = "REDACTED"
MAX_VALUE = 8192
# What `Secret.fill` makes of a name (the SDK refuses names with braces or control characters).
SECRET_MARKER = re.compile(r"\$\{e2b\.secrets\.([^{}]*)\}")
# Either kind of marker (`identity.IDENTITY_MARKER` for tokens), the kind in group 1.
_MARKERS = re.compile(r"\$\{e2b\.(secrets|identity\.tokens)\.([^{}]*)\}")

Headers = tuple[tuple[str, str], ...]
# A sandbox's workload identity token of a name (`identity`), minted now; None for a name its
# `iam` does not define.
TokenSource = Callable[[str], str | None]
# The headers a request gets, asked for as each request is sent (secrets are read then).
HeadersNow = Callable[[], Headers]


def shown(value: str) -> str:
    """What is shown of a rule's header value anywhere but the egress proxy: a value that is
    one secret or token marker as it is (it holds no credential, and tells what is sent), any
    other `REDACTED` (it may be a credential, or hold one beside a marker)."""
    markers = (SECRET_MARKER, IDENTITY_MARKER)
    return value if any(m.fullmatch(value) for m in markers) else REDACTED


class SecretValues(Protocol):
    def value(self, name: str, team_id: str) -> str | None:
        """The current value of `team_id`'s secret named `name`, None when there is none."""


class SecretUnavailable(ConnectionError):
    """A rule names a secret that has no value to send (the request is not sent)."""


def check_header(name: str, value: str) -> None:
    """ValueError unless `name: value` is a header a rule may set."""
    if not _TOKEN.fullmatch(name):
        raise ValueError(f"{name!r} is not a header name")
    if name.lower() in FRAMING:
        raise ValueError(f"{name!r} frames or routes the request and cannot be set by a rule")
    if len(value) > MAX_VALUE or not HEADER_VALUE.fullmatch(value):
        raise ValueError(f"the value of {name!r} is not a header value")


@dataclass(frozen=True)
class HeaderRule:
    """One domain's rule: `domain` canonical (`normalise`), `headers` in the order given."""

    domain: str
    headers: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "domain", normalise(self.domain))
        if len(self.headers) > MAX_HEADERS:
            raise ValueError(f"{self.domain}: at most {MAX_HEADERS} headers")
        for name, value in self.headers:
            check_header(name, value)


@dataclass(frozen=True)
class HeaderRules:
    rules: tuple[HeaderRule, ...] = ()

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(rule.domain for rule in self.rules))

    def headers_for(self, name: str) -> tuple[tuple[str, str], ...]:
        """The headers a request to host `name` gets, in the order they are applied; empty when
        no rule matches it."""
        matching = [r for r in self.rules if DomainRules((r.domain,)).allows(name)]
        matching.sort(key=lambda rule: not rule.domain.startswith("*."))
        return tuple(header for rule in matching for header in rule.headers)


NO_RULES = HeaderRules()


def resolve(
    headers: Headers,
    secrets: SecretValues | None,
    tokens: TokenSource | None = None,
    *,
    team_id: str,
) -> Headers:
    """`headers` with every secret marker replaced by the value of `team_id`'s secret (the
    sandbox's team's) now, and every token marker by a token minted now. Raises
    SecretUnavailable for a secret without one (or none of these: `secrets` is None), a token
    the sandbox does not define (or any token: `tokens` is None), or a value that cannot be a
    header's. The messages name the secret or token, never a value."""

    def value(marker: re.Match[str]) -> str:
        # One pass over both kinds: a secret's value is never read for markers.
        kind, named = marker[1], marker[2]
        if kind == "secrets":
            found = secrets.value(named, team_id) if secrets is not None else None
            if found is None:
                raise SecretUnavailable(f"secret {named!r} does not exist")
            return found
        found = tokens(named) if tokens is not None else None
        if found is None:
            raise SecretUnavailable(f"workload token {named!r} is not in the sandbox's iam")
        return found

    out = []
    for name, template in headers:
        filled = _MARKERS.sub(value, template)
        if len(filled) > MAX_VALUE or not HEADER_VALUE.fullmatch(filled):
            raise SecretUnavailable(f"the value of {name!r} with its secrets is not a header value")
        out.append((name, filled))
    return tuple(out)


def apply(
    headers: list[tuple[bytes, bytes]], rule_headers: tuple[tuple[str, str], ...]
) -> list[tuple[bytes, bytes]]:
    """`headers` (a request's, in order) with those a rule sets replaced or added."""
    out = list(headers)
    for name, value in rule_headers:
        lowered = name.lower().encode()
        out = [(n, v) for n, v in out if n.lower() != lowered]
        out.append((name.encode(), value.encode("latin-1")))
    return out
