"""Creating and destroying network slots, switching their egress, and reclaiming the slots a
crashed process left behind.

All netlink and nft work for one operation runs on one fresh thread (`netns.run_in`) that starts
in the host namespace and then moves into the slot's; nothing blocks the event loop. Creating a
slot costs one nft process (the slot's ruleset). Destroying one only drops the namespace's name:
the kernel then removes the namespace with its tap, veth pair (both ends), routes and rules in
the background, batching many namespaces per pass. Deleting the veth ourselves takes ~20 ms per
slot here (RCU grace periods, waited for under the RTNL lock that every netlink user needs). The
host table holds nothing per slot, so it is never touched.

Egress is the slot's default route: via the host when on, `prohibit` when off (the guest gets an
immediate "administratively prohibited" rather than a hang, and packets of connections already
open are refused too). Host-initiated flows never use the default route (replies go to the host's
end of the veth, on the connected /30), so the envd/proxy path works either way. A route is used
rather than an nft verdict because an nft batch that replaces rules waits for an RCU grace period
(~15 ms here, when nft closes its socket); replacing a route is one netlink message. The finer
`EgressPolicy` (allow/deny by destination) lives in the slot's nft sets and applies while egress
is on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from pathlib import Path

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl.ndmsg import NUD_PERMANENT

from aenv.network import netns, nft, rules
from aenv.network.addressing import SLOT_PREFIXLEN, AddressPlan
from aenv.network.config import NetworkConfig
from aenv.network.egress_ca import EgressCA, upstream_context
from aenv.network.egress_proxy import EgressCounts, EgressProxy, Interception
from aenv.network.policy import EgressPolicy
from aenv.network.slot import Slot

log = logging.getLogger(__name__)

_ENODEV = 19

_SLOT_SYSCTLS = {
    "net/ipv4/ip_forward": "1",
    # The guest network is IPv4 only; without IPv6 the slot has no link-local surface and sends
    # the guest no router solicitations or DAD probes. Set before any interface exists.
    "net/ipv6/conf/all/disable_ipv6": "1",
    "net/ipv6/conf/default/disable_ipv6": "1",
}


def _sysctl(key: str, value: str) -> None:
    # /proc/sys/net shows the namespace of the thread that opens it.
    Path("/proc/sys", key).write_text(value)


def _delete_link(ipr: IPRoute, ifname: str) -> None:
    try:
        ipr.link("del", ifname=ifname)
    except NetlinkError as error:
        if error.code != _ENODEV:
            raise


def _set_default_route(ns: IPRoute, slot: Slot, egress: bool) -> None:
    if egress:
        ns.route("replace", dst="0.0.0.0/0", gateway=str(slot.host_ip))
    else:
        ns.route("replace", dst="0.0.0.0/0", type="prohibit")


class SlotManager:
    def __init__(self, config: NetworkConfig) -> None:
        self.config = config
        self._plan = AddressPlan(config.slot_network)
        self._denied = config.denied
        self._slots: dict[int, Slot] = {}
        self._policies: dict[int, EgressPolicy] = {}
        # The egress proxies of slots whose policy names domains or a SOCKS5 proxy.
        self._proxies: dict[int, EgressProxy] = {}
        self.egress_counts = EgressCounts()
        self._interception: Interception | None = None
        # Per slot: changes to one slot's egress apply in the order they were asked for.
        self._locks: dict[int, asyncio.Lock] = {}
        self._orphans: set[asyncio.Future[None]] = set()
        self._name_re = re.compile(rf"{re.escape(config.prefix)}-(0|[1-9][0-9]*)")

    @property
    def egress_ca(self) -> bytes | None:
        return self._interception.ca.cert_pem if self._interception is not None else None

    @property
    def live(self) -> int:
        return len(self._slots)

    def _name(self, index: int) -> str:
        return f"{self.config.prefix}-{index}"

    async def start(self) -> None:
        """Reclaim every slot a previous process with this prefix left behind, then (re)create
        the host table and enable forwarding in the host namespace."""
        swept = await netns.run_in(self.config.host_netns, self._sweep_and_prepare)
        if self.config.egress_ca is not None:
            ca = await asyncio.to_thread(EgressCA, self.config.egress_ca)
            self._interception = Interception(
                ca,
                upstream_context(self.config.upstream_ca),
                self.config.secrets,
                self.config.signer,
                upstream_h2=upstream_context(self.config.upstream_ca, http2=True),
            )
        if swept:
            log.warning("reclaimed %d leftover network slots: %s", len(swept), ", ".join(swept))

    def _sweep_and_prepare(self) -> list[str]:
        swept = {name for name in netns.names() if self._name_re.fullmatch(name)}
        with IPRoute() as host:
            for link in host.get_links():
                ifname = link.get_attr("IFLA_IFNAME")
                if self._name_re.fullmatch(ifname):
                    _delete_link(host, ifname)
                    swept.add(ifname)
        for name in swept:
            netns.remove(name)
        _sysctl("net/ipv4/ip_forward", "1")
        config = self.config
        nft.apply(
            rules.host_table(
                config.prefix, f"{config.prefix}-", config.slot_network, config.server_uid
            )
        )
        return sorted(swept)

    async def create(
        self, *, egress: bool | None = None, policy: EgressPolicy | None = None
    ) -> Slot:
        verdict = self.config.egress if egress is None else egress
        initial = EgressPolicy() if policy is None else policy
        with contextlib.ExitStack() as undo:
            index = self._plan.allocate()
            undo.callback(self._plan.free, index)
            slot = Slot(
                index=index,
                netns=self._name(index),
                host_ifname=self._name(index),
                host_ip=self._plan.host_ip(index),
                address=self._plan.slot_ip(index),
                guest=self.config.guest,
            )
            work = asyncio.ensure_future(
                netns.run_in(self.config.host_netns, lambda: self._build(slot, verdict, initial))
            )
            try:
                await asyncio.shield(work)
            except asyncio.CancelledError:
                # The thread cannot be stopped: what it builds, and the index, are reclaimed
                # once it is done.
                undo.pop_all()
                orphan = asyncio.ensure_future(self._reclaim(slot, work))
                self._orphans.add(orphan)
                orphan.add_done_callback(self._orphans.discard)
                raise
            undo.pop_all()
        self._slots[index] = slot
        self._policies[index] = initial
        self._locks[index] = asyncio.Lock()
        if initial.needs_proxy:
            async with contextlib.AsyncExitStack() as undo_slot:
                undo_slot.push_async_callback(self.destroy, slot)
                await self._start_proxy(slot, initial)
                undo_slot.pop_all()
        return slot

    async def _reclaim(self, slot: Slot, work: asyncio.Future[None]) -> None:
        with contextlib.suppress(Exception):
            await work
        await asyncio.to_thread(netns.remove, slot.netns)
        self._plan.free(slot.index)

    def _build(self, slot: Slot, egress: bool, policy: EgressPolicy) -> None:
        guest = slot.guest
        with IPRoute() as host:
            # Before the undo: if the name is taken, it is not ours to remove.
            netns.create_and_enter(slot.netns)
            with contextlib.ExitStack() as undo:
                undo.callback(netns.remove, slot.netns)
                for key, value in _SLOT_SYSCTLS.items():
                    _sysctl(key, value)
                with IPRoute() as ns:
                    ns.link("set", index=socket.if_nametoindex("lo"), state="up")
                    ns.link("add", ifname=guest.tap, kind="tuntap", mode="tap", ifr={"no_pi": True})
                    tap = socket.if_nametoindex(guest.tap)
                    ns.link("set", index=tap, address=guest.gateway_mac, state="up")
                    ns.addr(
                        "add",
                        index=tap,
                        address=str(guest.gateway),
                        prefixlen=guest.ip.network.prefixlen,
                    )
                    # A permanent neighbour entry: the first host connection after a restore does
                    # not wait for the (possibly slow, TCG) guest to answer ARP.
                    ns.neigh(
                        "add",
                        dst=str(guest.ip.ip),
                        lladdr=guest.mac,
                        ifindex=tap,
                        state=NUD_PERMANENT,
                    )
                    # A slot that had this index may still be draining: its host end is gone only
                    # once the kernel has finished with its namespace.
                    _delete_link(host, slot.host_ifname)
                    host.link(
                        "add",
                        ifname=slot.host_ifname,
                        kind="veth",
                        peer={"ifname": rules.SLOT_UPLINK, "net_ns_fd": slot.netns},
                    )
                    outer = host.link_lookup(ifname=slot.host_ifname)[0]
                    host.addr(
                        "add", index=outer, address=str(slot.host_ip), prefixlen=SLOT_PREFIXLEN
                    )
                    host.link("set", index=outer, state="up")
                    inner = socket.if_nametoindex(rules.SLOT_UPLINK)
                    ns.addr("add", index=inner, address=str(slot.address), prefixlen=SLOT_PREFIXLEN)
                    ns.link("set", index=inner, state="up")
                    _set_default_route(ns, slot, egress)
                nft.apply(rules.slot_table(guest, policy, self._denied))
                undo.pop_all()

    async def destroy(self, slot: Slot) -> None:
        """Remove the slot. The VMM that ran in it must have exited: a process still inside keeps
        the namespace (unnamed, and cut off once its index is reused) alive until it exits."""
        self._check_live(slot)
        await self._stop_proxy(slot)
        # Dropping a name enters no namespace, so a pooled thread is fine here.
        await asyncio.to_thread(netns.remove, slot.netns)
        del self._slots[slot.index]
        del self._policies[slot.index]
        del self._locks[slot.index]
        self._plan.free(slot.index)

    def in_use(self) -> list[Slot]:
        """Every live slot (ready in a pool or handed out)."""
        return list(self._slots.values())

    async def remove_strays(self) -> list[str]:
        """Remove the namespaces named like this manager's slots that no live slot and no create
        under way stands for (a create whose clean-up failed, a slot dropped without `destroy`).
        Their indices are held meanwhile, so no new slot takes one of those names half-way."""
        names = await asyncio.to_thread(netns.names)
        strays: dict[str, int | None] = {}  # None: outside the plan (its network changed)
        for name in names:
            match = self._name_re.fullmatch(name)
            if match is None:
                continue
            index = int(match.group(1))
            if index >= self._plan.capacity:
                strays[name] = None
            elif self._plan.take(index):
                strays[name] = index
        try:
            for name in strays:
                await asyncio.to_thread(netns.remove, name)
        finally:
            for held in strays.values():
                if held is not None:
                    self._plan.free(held)
        return sorted(strays)

    def _check_live(self, slot: Slot) -> None:
        if self._slots.get(slot.index) != slot:
            raise ValueError(f"slot {slot.netns} is not live")

    async def set_egress(self, slot: Slot, enabled: bool) -> None:
        self._check_live(slot)

        def switch() -> None:
            with IPRoute() as ns:
                _set_default_route(ns, slot, enabled)

        async with self._locks[slot.index]:
            await netns.run_in(slot.netns, switch)

    async def set_policy(self, slot: Slot, policy: EgressPolicy) -> None:
        self._check_live(slot)
        async with self._locks[slot.index]:
            old = self._policies[slot.index]
            if policy == old:
                return
            # The proxy is up before connections are redirected to it, and down only after.
            async with contextlib.AsyncExitStack() as undo:
                if policy.needs_proxy:
                    await self._start_proxy(slot, policy)
                undo.push_async_callback(self._proxy_as, slot, old)
                await netns.run_in(slot.netns, lambda: nft.apply(rules.set_policy(old, policy)))
                undo.pop_all()
            self._policies[slot.index] = policy
            if not policy.needs_proxy:
                await self._stop_proxy(slot)

    async def _proxy_as(self, slot: Slot, policy: EgressPolicy) -> None:
        """The slot's egress proxy as `policy` has it: running with it, or stopped."""
        if policy.needs_proxy:
            await self._start_proxy(slot, policy)
        else:
            await self._stop_proxy(slot)

    async def _stop_proxy(self, slot: Slot) -> None:
        proxy = self._proxies.pop(slot.index, None)
        if proxy is not None:
            await proxy.close()

    async def _start_proxy(self, slot: Slot, policy: EgressPolicy) -> None:
        """Start the slot's egress proxy, or give the running one the new policy."""
        proxy = self._proxies.get(slot.index)
        if proxy is not None:
            proxy.policy = policy
            return
        proxy = EgressProxy(
            slot,
            policy,
            self._denied,
            self.config.dns_upstream,
            self.config.host_netns,
            self.egress_counts,
            self._interception,
        )
        await proxy.start()
        self._proxies[slot.index] = proxy

    async def close(self) -> None:
        """Destroy every live slot and remove the host table."""
        await asyncio.gather(*self._orphans)
        for slot in list(self._slots.values()):
            await self.destroy(slot)
        await netns.run_in(
            self.config.host_netns, lambda: nft.apply(rules.delete_table(self.config.prefix))
        )
