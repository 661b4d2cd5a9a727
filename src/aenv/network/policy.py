"""Per-slot egress policy: E2B's `allow_out` / `deny_out` as addresses and domain names.

Semantics follow E2B: with no lists everything is allowed; `deny` blocks its destinations unless
`allow` also covers them (allow wins). Domain names may only be allowed; a TCP connection that no
address rule allows is then judged by the name it asks for (`egress_proxy`). With a `proxy`
(the sandbox's own SOCKS5 proxy, `socks`), every TCP connection the lists and names allow is
tunneled through it. `headers` (E2B's `network.rules`, `header_rules`) are set on the HTTPS
requests of connections judged by name, with the sandbox's workload identity tokens
(`identity`) for the markers they name. The policy applies only while the slot's egress is on,
and never opens the host: the host-side rules drop slot traffic to the host whatever the policy
says.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, collapse_addresses, ip_network

from aenv.ids import TEAM_ID
from aenv.network.domains import is_address, normalise
from aenv.network.header_rules import NO_RULES, HeaderRules
from aenv.network.identity import WorkloadIdentity
from aenv.network.socks import SocksProxy


def _normalise(networks: Iterable[IPv4Network]) -> tuple[IPv4Network, ...]:
    # nft interval sets reject overlapping elements, so merge them here.
    return tuple(collapse_addresses(networks))


@dataclass(frozen=True)
class EgressPolicy:
    allow: tuple[IPv4Network, ...] = ()
    deny: tuple[IPv4Network, ...] = ()
    # Allowed names (`example.com`, `*.example.com`), canonical and sorted.
    domains: tuple[str, ...] = ()
    proxy: SocksProxy | None = None
    # The resolvers the slot's DNS forwarder asks for allowed names (E2B's `dnsServers`), in
    # order; None: the node's.
    dns_servers: tuple[IPv4Address, ...] | None = None
    headers: HeaderRules = NO_RULES
    identity: WorkloadIdentity | None = None
    # The team whose secrets `headers` name: the sandbox's (a rule never reads another
    # team's secrets).
    team_id: str = TEAM_ID

    def __post_init__(self) -> None:
        object.__setattr__(self, "allow", _normalise(self.allow))
        object.__setattr__(self, "deny", _normalise(self.deny))
        object.__setattr__(self, "domains", tuple(sorted({normalise(d) for d in self.domains})))

    @property
    def needs_proxy(self) -> bool:
        """Whether the slot's egress proxy must run: to judge names, or to tunnel."""
        return bool(self.domains) or self.proxy is not None

    def admits(self, address: IPv4Address) -> bool:
        """Whether the address lists let a connection to `address` through (names aside)."""
        if any(address in network for network in self.allow):
            return True
        return not any(address in network for network in self.deny)

    @classmethod
    def parse(
        cls,
        allow: Iterable[str] = (),
        deny: Iterable[str] = (),
        proxy: SocksProxy | None = None,
        dns_servers: Iterable[str] | None = None,
        headers: HeaderRules = NO_RULES,
    ) -> EgressPolicy:
        """From strings such as `1.1.1.1`, `8.8.8.0/24` or (allow only) `*.example.com`;
        anything else is a ValueError."""

        def networks(values: Iterable[str]) -> list[IPv4Network]:
            out = []
            for value in values:
                network = ip_network(value, strict=False)
                if not isinstance(network, IPv4Network):
                    raise ValueError(f"{value!r}: only IPv4 destinations are supported")
                out.append(network)
            return out

        entries = list(allow)
        names = [entry for entry in entries if not is_address(entry)]
        addresses = [entry for entry in entries if is_address(entry)]
        resolvers = None if dns_servers is None else tuple(map(IPv4Address, dns_servers))
        return cls(
            tuple(networks(addresses)),
            tuple(networks(deny)),
            tuple(names),
            proxy,
            resolvers,
            headers,
        )
