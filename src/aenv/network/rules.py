"""The nftables rulesets, as JSON batches for `nft.apply`.

Two tables, both static, so no slot ever needs a rule handle or a per-slot host element:

- The host table (`inet <prefix>` in the host namespace) matches slot interfaces by name prefix
  (`<prefix>-*`) and enforces what must hold for every slot: slots cannot reach each other or the
  host's own services, nobody but the host itself opens connections into a slot, and forwarded
  slot traffic leaving the host is masqueraded.
- The slot table (`inet aenv` in each slot namespace, the same in every slot) DNATs everything
  the host sends to the slot address onto the guest, masquerades the guest's egress to the slot
  address (every guest has the same IP, so the host could not route replies otherwise), and
  forwards only the guest's own address. It dies with the namespace, so teardown needs no nft call.

Whether a slot has egress is decided by its routing, not here (see `manager`).
"""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network
from typing import Any

from aenv.network.nft import Command
from aenv.network.slot import GuestNetwork

SLOT_TABLE = "aenv"
# The veth end inside each slot namespace. Fixed: the slot ruleset is the same everywhere.
SLOT_UPLINK = "eth0"

Expr = dict[str, Any]


def _is(key: str, value: str, op: str = "==") -> Expr:
    return {"match": {"op": op, "left": {"meta": {"key": key}}, "right": value}}


def _ct(key: str, values: str | list[str]) -> Expr:
    return {"match": {"op": "in", "left": {"ct": {"key": key}}, "right": values}}


def _saddr(value: IPv4Network | IPv4Address) -> Expr:
    right: Any = (
        {"prefix": {"addr": str(value.network_address), "len": value.prefixlen}}
        if isinstance(value, IPv4Network)
        else str(value)
    )
    return {
        "match": {
            "op": "==",
            "left": {"payload": {"protocol": "ip", "field": "saddr"}},
            "right": right,
        }
    }


_ACCEPT: Expr = {"accept": None}
_DROP: Expr = {"drop": None}
_ESTABLISHED = _ct("state", ["established", "related"])


# Base chain priorities, as nft names them: filter 0, dstnat -100, srcnat 100.
_HOOKS = {
    "input": ("filter", 0, "input"),
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


def host_table(table: str, ifname_prefix: str, slots: IPv4Network) -> list[Command]:
    """(Re)create the host table. Policies stay `accept`: the host's other traffic is not ours."""
    slot_if = f"{ifname_prefix}*"
    return [
        *_recreate(table),
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
            _saddr(slots),
            _is("oifname", slot_if, op="!="),
            {"masquerade": None},
        ),
    ]


def delete_table(table: str) -> list[Command]:
    return [{"add": {"table": _table(table)}}, {"delete": {"table": _table(table)}}]


def slot_table(guest: GuestNetwork) -> list[Command]:
    t, tap, up = SLOT_TABLE, guest.tap, SLOT_UPLINK
    return [
        {"add": {"table": _table(t)}},
        _chain(t, "prerouting"),
        # Every new flow from the host side is for the guest, whatever its port or protocol.
        _rule(
            t,
            "prerouting",
            _is("iifname", up),
            {"dnat": {"family": "ip", "addr": str(guest.ip.ip)}},
        ),
        _chain(t, "postrouting"),
        _rule(t, "postrouting", _is("oifname", up), {"masquerade": None}),
        # Nothing listens in the slot namespace; the guest has no business with it.
        _chain(t, "input", policy="drop"),
        _rule(t, "input", _is("iifname", "lo"), _ACCEPT),
        _rule(t, "input", _ESTABLISHED, _ACCEPT),
        _chain(t, "forward", policy="drop"),
        _rule(
            t, "forward", _is("iifname", up), _is("oifname", tap), _ct("status", "dnat"), _ACCEPT
        ),
        _rule(t, "forward", _is("iifname", up), _is("oifname", tap), _ESTABLISHED, _ACCEPT),
        _rule(t, "forward", _is("iifname", tap), _is("oifname", up), _saddr(guest.ip.ip), _ACCEPT),
    ]
