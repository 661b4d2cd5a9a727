"""Opening a slot's tap for a VMM: found by name in its namespace, with the flags QEMU itself
sets for `ifname=` (vnet header on), usable from outside the namespace."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
import struct
import subprocess
import threading
from collections.abc import Iterator

import pytest

from aenv.network.tap import IFF_NO_PI, IFF_TAP, IFF_VNET_HDR, open_tap
from tests.support.wait import eventually

TUNGETIFF = 0x800454D2
TUNGETVNETHDRSZ = 0x800454D7
TUN = "/dev/net/tun"


@pytest.fixture
def namespace() -> Iterator[str]:
    name = f"aenvt-tap-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(
            ["ip", "-n", name, "tuntap", "add", "dev", "tap0", "mode", "tap"], check=True
        )
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


async def test_the_tap_opens_with_qemus_flags(namespace: str) -> None:
    fd = await open_tap(namespace, "tap0")
    try:
        name, flags = struct.unpack("16sH22x", fcntl.ioctl(fd, TUNGETIFF, b"\0" * 40))
        assert name.rstrip(b"\0") == b"tap0"
        assert flags & (IFF_TAP | IFF_NO_PI | IFF_VNET_HDR) == IFF_TAP | IFF_NO_PI | IFF_VNET_HDR
        assert struct.unpack("i", fcntl.ioctl(fd, TUNGETVNETHDRSZ, b"\0" * 4))[0] == 10
        assert os.get_inheritable(fd) is False  # handed to a VMM only through pass_fds
    finally:
        os.close(fd)


async def test_a_missing_namespace_is_an_error(namespace: str) -> None:
    with pytest.raises(OSError):
        await open_tap(f"{namespace}-none", "tap0")


def _open_taps() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor
            count += os.readlink(f"/proc/self/fd/{fd}") == TUN
    return count


async def test_a_cancelled_open_leaves_no_file_open(namespace: str) -> None:
    before = _open_taps()
    opening = asyncio.ensure_future(open_tap(namespace, "tap0"))
    await asyncio.sleep(0)  # started: its thread opens the tap after the cancel
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    # The opening thread finishes on its own; once it has, nothing it opened may be left open.
    await eventually(
        lambda: all(t.name != f"netns:{namespace}" for t in threading.enumerate()),
        "the opening thread finished",
    )
    # The close is a callback of the loop's, after the one the thread's result comes back
    # with: a few loop turns later on a busy machine.
    await eventually(lambda: _open_taps() == before, "the cancelled open's tap closed")


async def test_a_refused_open_leaves_no_file_open(namespace: str) -> None:
    """The tap device is opened before the kernel is asked for the interface: a name it
    refuses fails the open after that, and the device's file is closed again."""
    before = _open_taps()
    with pytest.raises(OSError):
        await open_tap(namespace, "no/tap")
    assert _open_taps() == before
