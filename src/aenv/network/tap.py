"""Opening a slot's tap device for a VMM, which then gets the open file instead of a name.

A tap is attached to by name only in the network namespace that holds it, so the VMM would have
to run there; an open file works from anywhere, and the VMM can run in an empty namespace of its
own. The flags are those QEMU sets when it opens `ifname=` itself (net/tap-linux.c `tap_open`):
the vnet header is part of virtio-net's saved state, so snapshots taken either way restore
either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import struct

from aenv.network import netns

TUN_DEVICE = "/dev/net/tun"
TUNSETIFF = 0x400454CA
TUNGETFEATURES = 0x800454CF
TUNSETVNETHDRSZ = 0x400454D8
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_ONE_QUEUE = 0x2000
IFF_VNET_HDR = 0x4000
VIRTIO_NET_HDR_LEN = 10  # sizeof(struct virtio_net_hdr), what QEMU resets a persistent tap to


def _open_here(name: str) -> int:
    with contextlib.ExitStack() as undo:
        fd = os.open(TUN_DEVICE, os.O_RDWR | os.O_CLOEXEC)
        undo.callback(os.close, fd)
        features = struct.unpack("I", fcntl.ioctl(fd, TUNGETFEATURES, b"\0" * 4))[0]
        flags = IFF_TAP | IFF_NO_PI
        flags |= features & (IFF_ONE_QUEUE | IFF_VNET_HDR)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), flags))
        if features & IFF_VNET_HDR:
            fcntl.ioctl(fd, TUNSETVNETHDRSZ, struct.pack("i", VIRTIO_NET_HDR_LEN))
        undo.pop_all()
    return fd


async def open_tap(namespace: str, name: str) -> int:
    """An open file (close-on-exec) of the tap `name` in the network namespace `namespace`;
    the caller closes it once the VMM has it. A cancelled call closes the file it still gets."""
    opening = asyncio.ensure_future(netns.run_in(namespace, lambda: _open_here(name)))
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        opening.add_done_callback(_close_unwanted)
        raise


def _close_unwanted(opening: asyncio.Future[int]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        os.close(opening.result())
