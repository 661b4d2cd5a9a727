"""The nftables rulesets, as JSON batches for `nft.apply`.

Two tables, both static, so no slot ever needs a rule handle or a per-slot host element:

- The host table (`inet <prefix>` in the host namespace) matches slot interfaces by name prefix
  (`<prefix>-*`) and enforces what must hold for every slot: slots cannot reach each other or the
  host's own services, nobody but the host itself opens connections into a slot, and forwarded
  slot traffic leaving the host is masqueraded. Of the host's own processes only the server's
  user may open connections to a slot address: envd's port answers there without the proxy's
  checks, so another local user must not reach it (`meta skuid`).
- The slot table (`inet aenv` in each slot namespace, the same in every slot) DNATs everything
  the host sends to the slot address onto the guest, masquerades the guest's egress to the slot
  address (every guest has the same IP, so the host could not route replies otherwise), forwards
  only the guest's own IPv4 address (so no IPv6 at all), refuses the `reserved` ranges, and then
  applies the slot's `EgressPolicy` from two sets, `allow` and `deny`. When the policy names
  domains, the set `sniffed` holds 0.0.0.0/0, the guest's new TCP connections to addresses
  `allow` does not cover are redirected to the slot's `egress_proxy` and its DNS queries to the
  slot's `dns` forwarder. With a SOCKS5 proxy the set `proxied` holds 0.0.0.0/0 too, and the
  new TCP connections the address sets let through (and none to a reserved range, which stay
  refused below) are redirected to the same proxy, which tunnels them. It dies with the
  namespace, so teardown needs no nft call.

Whether a slot has egress at all is decided by its routing, not here (see `manager`).

An accept here does not override a drop in another table: on a host whose own firewall drops
forwarded packets (Docker sets the iptables FORWARD policy to DROP), slot egress needs an accept
for `<prefix>-*` interfaces there too. We never edit tables we do not own.
"""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network
from typing import Any

from aenv.network.dns import DNS_PORT
from aenv.network.egress_proxy import PROXY_PORT
from aenv.network.nft import Command
from aenv.network.policy import EgressPolicy
from aenv.network.slot import GuestNetwork

SLOT_TABLE = "aenv"
# The veth end inside each slot namespace. Fixed: the slot ruleset is the same everywhere.
SLOT_UPLINK = "eth0"

Expr = dict[str, Any]


def _is(key: str, value: str, op: str = "==") -> Expr:
    return {"match": {"op": op, "left": {"meta": {"key": key}}, "right": value}}


def _ct(key: str, values: str | list[str]) -> Expr:
    return {"match": {"op": "in", "left": {"ct": {"key": key}}, "right": values}}


def _value(value: IPv4Network | IPv4Address | str) -> Any:
    if isinstance(value, IPv4Network):
        return {"prefix": {"addr": str(value.network_address), "len": value.prefixlen}}
    return str(value)


def _ip(field: str, value: IPv4Network | IPv4Address | str, op: str = "==") -> Expr:
    left = {"payload": {"protocol": "ip", "field": field}}
    return {"match": {"op": op, "left": left, "right": _value(value)}}


def _l4_dport(protocol: str, port: int) -> Expr:
    left = {"payload": {"protocol": protocol, "field": "dport"}}
    return {"match": {"op": "==", "left": left, "right": port}}


_ACCEPT: Expr = {"accept": None}
_DROP: Expr = {"drop": None}
_REJECT: Expr = {"reject": {"type": "icmpx", "expr": "admin-prohibited"}}
_POLICY_SETS = ("allow", "deny")
_DENIED = "denied"
_SNIFFED = "sniffed"
_PROXIED = "proxied"
_EVERYTHING = IPv4Network("0.0.0.0/0")
_ESTABLISHED = _ct("state", ["established", "related"])


# Base chain priorities, as nft names them: filter 0, dstnat -100, srcnat 100.
_HOOKS = {
    "input": ("filter", 0, "input"),
    "output": ("filter", 0, "output"),
    "forward": ("filter", 0, "forward"),
    "prerouting": ("nat", -100, "prerouting"),
    "postrouting": ("nat", 100, "postrouting"),
}


def _table(name: str) -> dict[str, str]:
    return {"family": "inet", "name": name}


def _chain(table: str, name: str, policy: str = "accept") -> Command:
    spec: dict[str, Any] = {"family": "inet", "table": table, "name": name}
    if name in _HOOKS:
        kind, prio, hook = _HOOKS[name]
        spec.update(type=kind, hook=hook, prio=prio, policy=policy)
    return {"add": {"chain": spec}}


def _rule(table: str, chain: str, *expr: Expr) -> Command:
    return {"add": {"rule": {"family": "inet", "table": table, "chain": chain, "expr": list(expr)}}}


def _recreate(table: str) -> list[Command]:
    # add + delete + add: leaves an empty table whether or not one existed, in one atomic batch.
    return [
        {"add": {"table": _table(table)}},
        {"delete": {"table": _table(table)}},
        {"add": {"table": _table(table)}},
    ]


def host_table(
    table: str, ifname_prefix: str, slots: IPv4Network, server_uid: int
) -> list[Command]:
    """(Re)create the host table. Policies stay `accept`: the host's other traffic is not ours."""
    slot_if = f"{ifname_prefix}*"
    other_user = {"match": {"op": "!=", "left": {"meta": {"key": "skuid"}}, "right": server_uid}}
    return [
        *_recreate(table),
        _chain(table, "output"),
        # Packets the kernel sends without a socket (resets, ICMP) have no uid and never match.
        _rule(table, "output", _is("oifname", slot_if), _ct("state", "new"), other_user, _REJECT),
        _chain(table, "input"),
        _rule(table, "input", _is("iifname", slot_if), _ESTABLISHED, _ACCEPT),
        _rule(table, "input", _is("iifname", slot_if), _DROP),
        _chain(table, "forward"),
        _rule(table, "forward", _is("iifname", slot_if), _is("oifname", slot_if), _DROP),
        _rule(table, "forward", _is("oifname", slot_if), _ESTABLISHED, _ACCEPT),
        _rule(table, "forward", _is("oifname", slot_if), _DROP),
        _chain(table, "postrouting"),
        _rule(
            table,
            "postrouting",
            _ip("saddr", slots),
            _is("oifname", slot_if, op="!="),
            {"masquerade": None},
        ),
    ]


def delete_table(table: str) -> list[Command]:
    return [{"add": {"table": _table(table)}}, {"delete": {"table": _table(table)}}]


def slot_table(
    guest: GuestNetwork, policy: EgressPolicy, denied: tuple[IPv4Network, ...]
) -> list[Command]:
    t, tap, up = SLOT_TABLE, guest.tap, SLOT_UPLINK
    to_guest = (_is("iifname", up), _is("oifname", tap))
    from_guest = (_is("iifname", tap), _is("oifname", up))
    guests_own = (*from_guest, _ip("saddr", guest.ip.ip))
    guest_tcp = (_is("iifname", tap), _ip("saddr", guest.ip.ip), _is("l4proto", "tcp"))
    new_tcp = (*guest_tcp, _ip("daddr", f"@{_DENIED}", op="!="))
    to_proxy = {"redirect": {"port": PROXY_PORT}}
    return [
        {"add": {"table": _table(t)}},
        *(_policy_set(name) for name in (_DENIED, _SNIFFED, _PROXIED, *_POLICY_SETS)),
        _elements(_DENIED, denied),
        *set_policy(EgressPolicy(), policy),
        _chain(t, "prerouting"),
        # Every new flow from the host side is for the guest, whatever its port or protocol.
        _rule(
            t,
            "prerouting",
            _is("iifname", up),
            {"dnat": {"family": "ip", "addr": str(guest.ip.ip)}},
        ),
        # Tunneled: what `allow` covers, and what `deny` does not; never a reserved range.
        *(
            _rule(t, "prerouting", *new_tcp, _ip("daddr", f"@{_PROXIED}"), judged, to_proxy)
            for judged in (_ip("daddr", "@allow"), _ip("daddr", "@deny", op="!="))
        ),
        _rule(
            t,
            "prerouting",
            *guest_tcp,
            _ip("daddr", f"@{_SNIFFED}"),
            _ip("daddr", "@allow", op="!="),
            to_proxy,
        ),
        _rule(
            t,
            "prerouting",
            _is("iifname", tap),
            _ip("saddr", guest.ip.ip),
            _l4_dport("udp", DNS_PORT),
            _ip("daddr", f"@{_SNIFFED}"),
            {"redirect": {"port": DNS_PORT}},
        ),
        _chain(t, "postrouting"),
        _rule(t, "postrouting", _is("oifname", up), {"masquerade": None}),
        # Nothing listens in the slot namespace; the guest has no business with it.
        _chain(t, "input", policy="drop"),
        _rule(t, "input", _is("iifname", "lo"), _ACCEPT),
        _rule(t, "input", _ESTABLISHED, _ACCEPT),
        _rule(t, "input", _is("iifname", tap), _l4_dport("tcp", PROXY_PORT), _ACCEPT),
        _rule(t, "input", _is("iifname", tap), _l4_dport("udp", DNS_PORT), _ACCEPT),
        _chain(t, "forward", policy="drop"),
        # Host-initiated flows pass both ways whatever the policy.
        _rule(t, "forward", *to_guest, _ct("status", "dnat"), _ACCEPT),
        _rule(t, "forward", *from_guest, _ct("status", "dnat"), _ACCEPT),
        _rule(t, "forward", *to_guest, _ESTABLISHED, _ACCEPT),
        # The guest's own flows are judged packet by packet, not just when they start, so a new
        # policy also applies to connections already open. Reserved ranges come first: no
        # `allow` opens them.
        _rule(t, "forward", *guests_own, _ip("daddr", f"@{_DENIED}"), _REJECT),
        _rule(t, "forward", *guests_own, _ip("daddr", "@allow"), _ACCEPT),
        # Rejected, not dropped: the guest fails at once instead of waiting for a timeout.
        _rule(t, "forward", *guests_own, _ip("daddr", "@deny"), _REJECT),
        _rule(t, "forward", *guests_own, _ACCEPT),
    ]


def _policy_set(name: str) -> Command:
    spec = {"family": "inet", "table": SLOT_TABLE, "name": name}
    return {"add": {"set": {**spec, "type": "ipv4_addr", "flags": ["interval"]}}}


def _elements(name: str, networks: tuple[IPv4Network, ...]) -> Command:
    spec = {"family": "inet", "table": SLOT_TABLE, "name": name}
    return {"add": {"element": {**spec, "elem": [_value(n) for n in networks]}}}


def set_policy(old: EgressPolicy, new: EgressPolicy) -> list[Command]:
    """Replace `old` by `new`. Sets that were empty are not flushed: a batch that deletes
    anything waits for an RCU grace period (~15 ms here), one that only adds does not."""
    commands: list[Command] = []
    for name, before, after in (("allow", old.allow, new.allow), ("deny", old.deny, new.deny)):
        spec = {"family": "inet", "table": SLOT_TABLE, "name": name}
        if before:
            commands.append({"flush": {"set": spec}})
        if after:
            commands.append(_elements(name, after))
    for name, was_on, on in (
        (_SNIFFED, bool(old.domains), bool(new.domains)),
        (_PROXIED, old.proxy is not None, new.proxy is not None),
    ):
        if was_on != on:
            spec = {"family": "inet", "table": SLOT_TABLE, "name": name}
            commands.append(_elements(name, (_EVERYTHING,)) if on else {"flush": {"set": spec}})
    return commands
