"""The host-side address plan: a configured IPv4 network carved into /30s, one per slot.

Slot `i` owns the i-th /30: its first usable address is the host's end of the veth and the second
is the slot's `address` (the namespace's end, where the host reaches the guest). Indices are handed
out round-robin: a freed index is reused as late as possible, so the kernel has normally finished
removing the previous holder's namespace (and its host interface) before the index comes back.
"""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network

SLOT_PREFIXLEN = 30


class SlotsExhausted(RuntimeError):
    """Every /30 of the configured network is in use."""


class AddressPlan:
    def __init__(self, network: IPv4Network) -> None:
        if network.prefixlen > SLOT_PREFIXLEN:
            raise ValueError(f"{network} is smaller than one /{SLOT_PREFIXLEN}")
        self.network = network
        self.capacity = 1 << (SLOT_PREFIXLEN - network.prefixlen)
        self._cursor = 0
        self._used: set[int] = set()

    def subnet(self, index: int) -> IPv4Network:
        if not 0 <= index < self.capacity:
            raise ValueError(f"slot index {index} outside {self.network}")
        base = int(self.network.network_address) + (index << (32 - SLOT_PREFIXLEN))
        return IPv4Network((base, SLOT_PREFIXLEN))

    def host_ip(self, index: int) -> IPv4Address:
        return self.subnet(index).network_address + 1

    def slot_ip(self, index: int) -> IPv4Address:
        return self.subnet(index).network_address + 2

    def allocate(self) -> int:
        for step in range(self.capacity):
            index = (self._cursor + step) % self.capacity
            if index not in self._used:
                self._used.add(index)
                self._cursor = index + 1
                return index
        raise SlotsExhausted(f"all {self.capacity} slots of {self.network} are in use")

    def take(self, index: int) -> bool:
        """Mark `index` used if it is free (e.g. to remove what a slot of it left); False when
        it is in use."""
        if index in self._used:
            return False
        self.subnet(index)  # checks the range
        self._used.add(index)
        return True

    def free(self, index: int) -> None:
        if index not in self._used:
            raise ValueError(f"slot index {index} is not allocated")
        self._used.remove(index)

    @property
    def in_use(self) -> int:
        return len(self._used)
