"""Per-sandbox network slots: a network namespace with the VM's tap and a veth to the host, the
same guest address everywhere, a unique host-side address per slot, switchable NAT egress, and
isolation between slots and from the host. `SlotPool` is the entry point."""

from aenv.network.addressing import SlotsExhausted
from aenv.network.config import NetworkConfig
from aenv.network.manager import SlotManager
from aenv.network.nft import NftError
from aenv.network.pool import SlotPool, SlotProvider
from aenv.network.slot import GuestNetwork, Slot

__all__ = [
    "GuestNetwork",
    "NetworkConfig",
    "NftError",
    "Slot",
    "SlotManager",
    "SlotPool",
    "SlotProvider",
    "SlotsExhausted",
]
