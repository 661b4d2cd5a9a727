"""A sandbox's network settings as E2B defines them, and the slot configuration they mean.

E2B's knobs: `allow_internet_access`, `network.allowOut` / `denyOut` (IPs, CIDRs and, to
allow, domain names; allow wins over deny), `egressProxy` (a SOCKS5 proxy the allowed TCP is
tunneled through), `dnsServers` (the resolvers a sandbox with domain rules gets its answers
from), `allowPublicTraffic` (ingress only with the traffic access token), `maskRequestHost` and
`httpsPorts` (ports whose service speaks HTTPS: the data-plane proxy reaches them over TLS) and
`rules` (headers set on HTTPS requests to given domains, `header_rules`); and beside them the
sandbox's workload identity tokens (E2B's `iam`, `identity`), which those headers may name.
They belong to the sandbox, not to its slot: they are
stored with it, applied to every slot it runs in (create, resume, fork children) and replaced
at runtime by `PUT /sandboxes/{id}/network`.

Egress maps onto a slot as E2B's infra does it: no internet access is a `denyOut` of 0.0.0.0/0,
which `allowOut` still overrides. When nothing at all is allowed the slot's route is switched off
instead, which also refuses packets of connections already open without an nft change. Domain
names need everything else denied (as in E2B: allowing a name among allowed addresses would
mean nothing). Header rules need the same: they apply to connections judged by name, and with
everything else denied no connection to their domains goes out any other way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from ipaddress import IPv4Network
from typing import Any

from aenv.network.header_rules import NO_RULES, HeaderRule, HeaderRules, shown
from aenv.network.identity import IDENTITY_MARKER, NO_TOKENS, IdentityTokens
from aenv.network.policy import EgressPolicy
from aenv.network.socks import SocksProxy

ALL_TRAFFIC = "0.0.0.0/0"


@dataclass(frozen=True)
class SlotEgress:
    """What a slot is given: its egress route on or off, and its allow/deny sets."""

    enabled: bool
    policy: EgressPolicy


@dataclass(frozen=True)
class SandboxNetwork:
    """`allow_out`/`deny_out` keep the user's strings (shown back in the sandbox's info as
    given). Raises ValueError for an entry that is neither an IPv4 address, a CIDR nor (in
    `allow_out`) a domain name, and for names without everything else denied."""

    allow_internet: bool = True
    allow_out: tuple[str, ...] = ()
    deny_out: tuple[str, ...] = ()
    allow_public_traffic: bool = True
    mask_request_host: str | None = None
    egress_proxy: SocksProxy | None = None
    dns_servers: tuple[str, ...] | None = None
    https_ports: tuple[int, ...] = ()
    rules: HeaderRules = NO_RULES
    iam: IdentityTokens = NO_TOKENS
    # Derived, for the slot; not part of the stored form.
    egress: SlotEgress = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_tokens(self)
        object.__setattr__(self, "egress", _slot_egress(self))

    def to_json(self) -> dict[str, Any]:
        return {
            "allow_internet": self.allow_internet,
            "allow_out": list(self.allow_out),
            "deny_out": list(self.deny_out),
            "allow_public_traffic": self.allow_public_traffic,
            "mask_request_host": self.mask_request_host,
            "egress_proxy": self.egress_proxy.to_json() if self.egress_proxy else None,
            "https_ports": list(self.https_ports),
            "dns_servers": None if self.dns_servers is None else list(self.dns_servers),
            "rules": [
                {"domain": rule.domain, "headers": [list(h) for h in rule.headers]}
                for rule in self.rules.rules
            ],
            "iam": [list(token) for token in self.iam.tokens],
        }

    def redacted_json(self) -> dict[str, Any]:
        """`to_json` without its secrets, for what others read (events, webhooks): the egress
        proxy's password and CA certificates left out, header rules' values as `shown`."""
        data = self.to_json()
        if data["egress_proxy"] is not None:
            data["egress_proxy"] = {
                k: v for k, v in data["egress_proxy"].items() if k not in ("password", "ca_cert")
            }
        for rule in data["rules"]:
            rule["headers"] = [[name, shown(value)] for name, value in rule["headers"]]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SandboxNetwork:
        proxy, resolvers = data.get("egress_proxy"), data.get("dns_servers")
        return cls(
            allow_internet=bool(data.get("allow_internet", True)),
            allow_out=tuple(data.get("allow_out", ())),
            deny_out=tuple(data.get("deny_out", ())),
            allow_public_traffic=bool(data.get("allow_public_traffic", True)),
            mask_request_host=data.get("mask_request_host"),
            egress_proxy=SocksProxy.from_json(proxy) if proxy else None,
            https_ports=tuple(data.get("https_ports", ())),
            dns_servers=None if resolvers is None else tuple(resolvers),
            rules=HeaderRules(
                tuple(
                    HeaderRule(rule["domain"], tuple((n, v) for n, v in rule["headers"]))
                    for rule in data.get("rules", ())
                )
            ),
            iam=IdentityTokens(tuple((n, a) for n, a in data.get("iam", ()))),
        )


def _check_tokens(network: SandboxNetwork) -> None:
    """ValueError for a rule naming a workload token the sandbox's `iam` does not define: it
    would send nothing, ever (E2B's SDK refuses it too)."""
    for rule in network.rules.rules:
        for _, value in rule.headers:
            for name in IDENTITY_MARKER.findall(value):
                if network.iam.audience(name) is None:
                    raise ValueError(
                        f"rules: {rule.domain} names workload token {name!r}, which iam does "
                        "not define"
                    )


def _slot_egress(network: SandboxNetwork) -> SlotEgress:
    allowed = EgressPolicy.parse(
        network.allow_out, network.deny_out, network.egress_proxy, network.dns_servers
    )
    deny = allowed.deny if network.allow_internet else (IPv4Network(ALL_TRAFFIC),)
    denies_all = IPv4Network(ALL_TRAFFIC) in deny
    if allowed.domains and not denies_all:
        raise ValueError(
            "When specifying allowed domains in allow out, you must include 'ALL_TRAFFIC' "
            "in deny out to block all other traffic."
        )
    if network.rules.rules and not denies_all:
        raise ValueError(
            "rules apply to connections judged by name: they need 'ALL_TRAFFIC' in deny out, "
            "and their domains in allow out"
        )
    if network.dns_servers is not None and not allowed.domains:
        raise ValueError("dnsServers are the resolvers of domain rules: allowOut names none")
    enabled = bool(allowed.allow) or bool(allowed.domains) or not denies_all
    policy = EgressPolicy(
        allowed.allow, deny, allowed.domains, allowed.proxy, allowed.dns_servers, network.rules
    )
    return SlotEgress(enabled, policy)
