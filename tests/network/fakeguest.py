"""A stand-in for the VM behind a slot's tap, for tests that must push real traffic through it.

It attaches to the slot's tap exactly as a VMM does (TUNSETIFF by name, from inside the slot's
namespace), and wires it frame by frame to a tap in a separate "guest" namespace that is
configured as the guest kernel would be (fixed IP and MAC, default route via the gateway). So every
packet crosses the real tap device, the slot's rules and the veth, just as with QEMU or Firecracker;
only the guest's kernel is the host's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import struct
import threading
from ipaddress import IPv4Address, IPv4Interface

from pyroute2 import IPRoute

from aenv.network import netns
from aenv.network.slot import Slot

_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000


def attach_tap(name: str) -> int:
    """Open tap `name` in the calling thread's namespace (a transient one is made if absent)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    return fd


def configure_nic(ifname: str, mac: str, ip: IPv4Interface, gateway: IPv4Address) -> None:
    """Set up this namespace as the guest kernel would: `ifname` (an attached tap) with the
    guest's MAC and address, up, and the default route via the gateway."""
    with IPRoute() as ipr:
        ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        eth0 = ipr.link_lookup(ifname=ifname)[0]
        ipr.link("set", index=eth0, address=mac, state="up")
        ipr.addr("add", index=eth0, address=str(ip.ip), prefixlen=ip.network.prefixlen)
        ipr.route("add", dst="0.0.0.0/0", gateway=str(gateway))


def wire(a: int, b: int, stop: int) -> None:
    """Copy frames between taps `a` and `b` until `stop` is readable."""
    while True:
        ready, _, _ = select.select([a, b, stop], [], [])
        if stop in ready:
            return
        for src in ready:
            frame = os.read(src, 65536)
            # A real NIC drops frames it cannot deliver, too.
            with contextlib.suppress(OSError):
                os.write(b if src == a else a, frame)


class FakeGuest:
    def __init__(self, slot: Slot) -> None:
        self.slot = slot
        # Not of the form <prefix>-<n>, so no slot sweep ever mistakes it for a slot.
        self.netns = f"{slot.netns}-guest"
        self._fds: list[int] = []
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        guest = self.slot.guest
        self._fds.append(await netns.run_in(self.slot.netns, lambda: attach_tap(guest.tap)))

        def boot() -> int:
            netns.create_and_enter(self.netns)
            fd = attach_tap("eth0")
            configure_nic("eth0", guest.mac, guest.ip, guest.gateway)
            return fd

        self._fds.append(await netns.run_in(None, boot))
        stop_r, stop_w = os.pipe()
        self._fds += [stop_r, stop_w]
        self._thread = threading.Thread(
            target=wire, args=(self._fds[0], self._fds[1], stop_r), daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            os.write(self._fds[3], b"x")
            self._thread.join()
            self._thread = None
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        if self.netns in netns.names():
            netns.remove(self.netns)
