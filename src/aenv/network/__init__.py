"""Per-sandbox network slots: a network namespace with the VM's tap and a veth to the host, the
same guest address everywhere, a unique host-side address per slot, switchable NAT egress, and
isolation between slots and from the host's own services. Egress follows an `EgressPolicy`
(addresses allowed and denied, domain names judged by `egress_proxy` and `dns`), never reaching
the `reserved` ranges; `settings` maps a sandbox's E2B network settings onto it.

Use from the orchestrator::

    pool = SlotPool(NetworkConfig())          # once per server
    await pool.start()                        # sweeps leftovers, prepares the host, warms up
    slot = await pool.acquire(egress=True)    # microseconds when the pool is warm
    # run the VMM inside slot.netns on tap slot.guest.tap with MAC slot.guest.mac;
    # envd is at http://{slot.address}:49983, any guest port at slot.address:<port>
    await pool.set_egress(slot, False)        # at any time
    await pool.set_policy(slot, EgressPolicy.parse(allow=["1.1.1.1"], deny=["0.0.0.0/0"]))
    await pool.set_policy(slot, EgressPolicy.parse(allow=["*.pypi.org"], deny=["0.0.0.0/0"]))
    await pool.release(slot)                  # after the VMM has exited
    await pool.close()                        # at shutdown
"""

from aenv.network.addressing import SlotsExhausted
from aenv.network.config import NetworkConfig
from aenv.network.manager import SlotManager
from aenv.network.nft import NftError
from aenv.network.policy import EgressPolicy
from aenv.network.pool import SlotPool, SlotProvider, SlotReclaimer
from aenv.network.slot import GuestNetwork, Slot

__all__ = [
    "EgressPolicy",
    "GuestNetwork",
    "NetworkConfig",
    "NftError",
    "Slot",
    "SlotManager",
    "SlotPool",
    "SlotProvider",
    "SlotReclaimer",
    "SlotsExhausted",
]
