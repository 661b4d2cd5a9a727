"""Domain names in egress rules: which entries are names, and which host names a rule allows.

A rule is a name (`example.com`: that name only) or a wildcard (`*.example.com`: every name
below it, at any depth, but not `example.com` itself). Names compare case-insensitively and
without a trailing dot, as DNS does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from ipaddress import ip_network

_LABEL = r"(?!-)[a-z0-9_-]{1,63}(?<!-)"
_NAME = re.compile(rf"(\*\.)?({_LABEL}\.)*{_LABEL}")
_MAX_NAME = 253


def is_address(entry: str) -> bool:
    """An IP address or CIDR (E2B's other kind of entry)."""
    try:
        ip_network(entry, strict=False)
    except ValueError:
        return False
    return True


def normalise(entry: str) -> str:
    """The rule `entry` in canonical form; ValueError if it is not a name or `*.` wildcard."""
    name = entry.strip().lower().rstrip(".")
    if len(name) > _MAX_NAME or not _NAME.fullmatch(name) or is_address(name):
        raise ValueError(f"{entry!r} is neither an IP address, a CIDR nor a domain name")
    return name


@dataclass(frozen=True)
class DomainRules:
    rules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(sorted({normalise(r) for r in self.rules})))

    def allows(self, host: str) -> bool:
        name = host.lower().rstrip(".")
        for rule in self.rules:
            if rule.startswith("*."):
                if name.endswith(rule[1:]):
                    return True
            elif name == rule:
                return True
        return False
