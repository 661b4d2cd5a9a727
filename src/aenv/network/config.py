"""Settings of the network slot layer, with defaults that work on one machine."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

from aenv.network.addressing import AddressPlan
from aenv.network.header_rules import SecretValues
from aenv.network.identity import Signer
from aenv.network.reserved import denied_ranges
from aenv.network.slot import GuestNetwork

_IFNAMSIZ = 15


@dataclass(frozen=True)
class NetworkConfig:
    """`prefix` names everything this layer owns: slot namespaces and host interfaces are
    `<prefix>-<index>`, the host nftables table is `inet <prefix>`. Two processes with different
    prefixes (a server and a test run, say) never touch each other's slots.

    `host_netns` is the namespace that plays the host: None is the namespace this process runs in
    (the root namespace in production); tests pass a namespace of their own so they never change
    the real host's interfaces, sysctls or rules."""

    prefix: str = "aenv"
    slot_network: IPv4Network = field(default_factory=lambda: IPv4Network("10.200.0.0/16"))
    host_netns: str | None = None
    guest: GuestNetwork = field(default_factory=GuestNetwork)
    # The egress verdict a new slot starts with (DESIGN: on by default).
    egress: bool = True
    # The warm pool refills in the background to `pool_high` when it drops below `pool_low`.
    pool_low: int = 4
    pool_high: int = 16
    # Parts of the private and CGNAT ranges that sandboxes may reach (see `reserved`).
    private_allowed: tuple[IPv4Network, ...] = ()
    # Further ranges no sandbox may reach: the cluster's own addresses, say.
    internal: tuple[IPv4Network, ...] = ()
    # The resolver that slots with domain rules get their allowed names from (see `dns`).
    dns_upstream: IPv4Address = field(default_factory=lambda: IPv4Address("1.1.1.1"))
    # Where the node's egress CA lives (`egress_ca`); None: header rules are never applied,
    # and connections they would apply to are refused.
    egress_ca: Path | None = None
    # A CA bundle servers of header-ruled names may also verify against (the host's trust
    # store always counts).
    upstream_ca: Path | None = None
    # Where the egress proxies read the secrets header rules name (`header_rules.resolve`);
    # None: a request whose rule names one is not sent.
    secrets: SecretValues | None = field(default=None, compare=False)
    # Who signs the workload identity tokens rules name (`identity`); None: a request whose
    # rule names one is not sent.
    signer: Signer | None = field(default=None, compare=False)
    # The only user whose processes may open connections to slot addresses (the server's).
    server_uid: int = field(default_factory=os.geteuid)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9]*", self.prefix):
            raise ValueError(f"prefix {self.prefix!r}: lowercase letters and digits only")
        capacity = AddressPlan(self.slot_network).capacity
        longest = f"{self.prefix}-{capacity - 1}"
        if len(longest) > _IFNAMSIZ:
            raise ValueError(f"interface name {longest!r} would exceed {_IFNAMSIZ} characters")
        if not 0 <= self.pool_low <= self.pool_high:
            raise ValueError("need 0 <= pool_low <= pool_high")
        if self.slot_network.overlaps(self.guest.ip.network):
            raise ValueError(f"slot_network {self.slot_network} overlaps the guest network")

    @property
    def denied(self) -> tuple[IPv4Network, ...]:
        """The destinations every slot refuses, whatever its policy. The guests' own network
        too: its gateway is the slot namespace, where the domain proxy and DNS forwarder listen,
        and a proxy told to connect to itself would loop."""
        internal = (*self.internal, self.guest.ip.network)
        return denied_ranges(self.slot_network, self.private_allowed, internal)
