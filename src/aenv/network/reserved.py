"""The destinations no sandbox may reach, whatever its egress policy allows.

Two groups:

- Always denied: "this network", loopback, link-local (169.254.169.254 is the cloud metadata
  service on most hosts), multicast and the reserved block, the node's own slot network (every
  other sandbox) and any further internal ranges the operator names (a cluster's own addresses).
- Denied unless the operator opts them in: the private ranges (10/8, 172.16/12, 192.168/16) and
  CGNAT (100.64/10), where a node's LAN, its cloud's internal services and other tenants live.
  An opt-in may name a part of a range (10.1.0.0/16 opens just that part).

The node's own addresses are not listed: a slot's packets to any of them are local deliveries in
the host namespace, which the host table drops (see `rules`). IPv6 needs no list: guests have no
IPv6 path at all (slots disable it, and the slot table drops what a guest sends anyway).
"""

from __future__ import annotations

from collections.abc import Iterable
from ipaddress import IPv4Network, collapse_addresses

ALWAYS_DENIED = tuple(
    IPv4Network(n)
    for n in ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4")
)
PRIVATE = tuple(
    IPv4Network(n) for n in ("10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.168.0.0/16")
)


def _subtract(ranges: Iterable[IPv4Network], holes: Iterable[IPv4Network]) -> list[IPv4Network]:
    remaining = list(ranges)
    for hole in holes:
        pieces: list[IPv4Network] = []
        for block in remaining:
            if hole.supernet_of(block):
                continue
            if block.supernet_of(hole):
                pieces.extend(block.address_exclude(hole))
            else:
                pieces.append(block)
        remaining = pieces
    return remaining


def denied_ranges(
    slot_network: IPv4Network,
    private_allowed: Iterable[IPv4Network] = (),
    internal: Iterable[IPv4Network] = (),
) -> tuple[IPv4Network, ...]:
    """Every range a slot must never reach, merged (nft interval sets refuse overlaps).
    `private_allowed` opens parts of `PRIVATE` only: it cannot open the slot network, an
    always-denied range or an operator's `internal` range."""
    private = _subtract(PRIVATE, private_allowed)
    return tuple(collapse_addresses([*ALWAYS_DENIED, slot_network, *internal, *private]))
