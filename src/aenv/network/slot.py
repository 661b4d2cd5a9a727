"""What a network slot is: the typed description the orchestrator, the runtime and the proxy use.

A slot is one sandbox's network: a named network namespace holding the VM's tap device and one end
of a veth pair whose other end sits in the host namespace. Every guest is configured identically
(`GuestNetwork`), so a snapshot restores into any slot unchanged; only the slot's `address` differs,
and connecting to `address:<port>` from the host reaches `guest.ip:<port>`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Interface
from pathlib import Path

from aenv.network.netns import RUN_DIR


@dataclass(frozen=True)
class GuestNetwork:
    """The guest side of every slot. Identical everywhere on purpose: the guest's IP, its MAC and
    the gateway's MAC are part of a snapshot's state (interface config, ARP cache), so they must not
    change when the snapshot is restored into another slot."""

    ip: IPv4Interface = field(default_factory=lambda: IPv4Interface("10.0.2.15/24"))
    gateway: IPv4Address = field(default_factory=lambda: IPv4Address("10.0.2.2"))
    # QEMU's default first NIC address, so a template booted without an explicit MAC still matches.
    mac: str = "52:54:00:12:34:56"
    # The tap plays the gateway. QEMU's slirp gateway has this MAC, so guests booted with user-mode
    # networking keep a valid ARP cache when they are restored behind a tap.
    gateway_mac: str = "52:55:0a:00:02:02"
    tap: str = "tap0"

    def __post_init__(self) -> None:
        if self.gateway not in self.ip.network or self.gateway == self.ip.ip:
            raise ValueError(f"gateway {self.gateway} must be another address in {self.ip.network}")


@dataclass(frozen=True)
class Slot:
    """One ready network slot.

    The VMM must run inside `netns` (`ip netns exec <netns> ...`, or setns to `netns_path`) and
    attach its NIC to the tap `guest.tap` with MAC `guest.mac`. The host reaches the guest's ports
    at `address`; the guest sees such connections coming from `host_ip`.
    """

    index: int
    netns: str
    host_ifname: str
    host_ip: IPv4Address
    address: IPv4Address
    guest: GuestNetwork

    @property
    def netns_path(self) -> Path:
        return RUN_DIR / self.netns
