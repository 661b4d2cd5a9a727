"""The guest of the Firecracker double (`fc_peer.py` with a guest): a real envd behind a real NIC.

Firecracker cannot run here (no usable KVM), so the double stands in for the guest as well: this
program, started by the peer in a network namespace of its own, plays the guest's NIC and disk.

- NIC: the peer opens the host tap named in the VM's network interface (as Firecracker does, in
  the namespace the VMM runs in) and passes it here; this program makes the guest's `eth0` (a tap
  of its own namespace, with the MAC and address the VM was given: `aenv.ip=`/`aenv.gw=` on the
  kernel command line) and copies Ethernet frames between the two, as the network tests'
  `FakeGuest` does. So the host reaches the guest exactly as it reaches a VM: through the slot's
  tap, with ARP and all.
- Disk: the guest's root is the host's `/` (read-only in effect) with the VM's writable drive as
  its upper layer, an ext4 image read with `debugfs` at start and written back whole with
  `mke2fs -d` when the VM pauses. So what a sandbox writes lives in the drive file that the driver
  seals, copies and exports, and a raw image is all it can read (a qcow2 fails `debugfs`).
- envd: `python -m aenv.envd` as PID 1 of a throwaway root (`tests/support/throwaway_root.sh`),
  listening on envd's port in this namespace.

Memory is not modelled: a restored guest is a fresh envd on the saved disk (the orchestrator
initialises envd after every restore anyway). Commands on stdin, one per line, answered `ok`:
`pause` (frames stop, envd is stopped with SIGSTOP, the upper layer is written to the drive) and
`resume`. It dies with the peer (parent-death signal), and envd with it.

    python -m tests.runtime.firecracker.fc_guest --tap-fd N --mac MAC --cmdline CMDLINE \
        --drive IMAGE --scratch DIR
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
from ipaddress import IPv4Address, IPv4Interface
from pathlib import Path

from tests.network.fakeguest import attach_tap, configure_nic, wire
from tests.support.envd_process import HARNESS, python_paths

ENVD_PORT = 49983
UPPER_LABEL = "aenv-upper"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """For `preexec_fn`: SIGKILL when the parent dies, like threads of a killed VMM."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def make_nic(mac: str, cmdline: str) -> int:
    """The guest's `eth0`, configured as its kernel command line says (`aenv.ip=`, `aenv.gw=`)."""
    args = dict(part.split("=", 1) for part in cmdline.split() if "=" in part)
    fd = attach_tap("eth0")
    configure_nic("eth0", mac, IPv4Interface(args["aenv.ip"]), IPv4Address(args["aenv.gw"]))
    return fd


class Guest:
    def __init__(self, drive: Path, scratch: Path) -> None:
        self.drive = drive
        self.scratch = scratch
        self.upper = scratch / "upper"
        self.envd: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.upper.mkdir(parents=True)
        (self.scratch / "work").mkdir()
        (self.scratch / "root").mkdir()
        # The drive's files become the upper layer; `debugfs` reads ext4 images only.
        subprocess.run(
            ["debugfs", "-R", f"rdump / {self.upper}", str(self.drive)],
            check=True,
            capture_output=True,
        )
        if not (self.upper / "lost+found").is_dir():
            raise RuntimeError(f"{self.drive} holds no ext4 filesystem")
        envd = [sys.executable, "-m", "aenv.envd", "--host", "0.0.0.0", "--port", str(ENVD_PORT)]
        log = (self.scratch / "envd.log").open("wb")
        harness = [str(HARNESS), "--upper", str(self.scratch), str(self.scratch / "root")]
        self.envd = subprocess.Popen(
            [*harness, *python_paths(), "--", *envd],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )

    def pause(self) -> None:
        assert self.envd is not None
        os.killpg(self.envd.pid, signal.SIGSTOP)
        size = self.drive.stat().st_size
        mke2fs = ["mke2fs", "-q", "-t", "ext4", "-F", "-O", "^has_journal", "-L", UPPER_LABEL]
        subprocess.run(
            [*mke2fs, "-d", str(self.upper), str(self.drive), f"{size // 1024}k"],
            check=True,
            capture_output=True,
        )

    def resume(self) -> None:
        assert self.envd is not None
        os.killpg(self.envd.pid, signal.SIGCONT)


class Wire:
    """The cable between the host's tap and the guest's, cut while the VM is paused (a paused VM
    reads no frames: the tap queues them, then drops)."""

    def __init__(self, host_tap: int, guest_tap: int) -> None:
        self.taps = (host_tap, guest_tap)
        self._stop: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    def connect(self) -> None:
        self._stop = os.pipe()
        self._thread = threading.Thread(target=wire, args=(*self.taps, self._stop[0]), daemon=True)
        self._thread.start()

    def cut(self) -> None:
        assert self._stop is not None and self._thread is not None
        os.write(self._stop[1], b"x")
        self._thread.join()
        for fd in self._stop:
            os.close(fd)


def obey(wire_: Wire, guest: Guest) -> None:
    """Follow the peer's commands on stdin until it closes it."""
    for line in sys.stdin:
        if line.strip() == "pause":
            wire_.cut()
            guest.pause()
        elif line.strip() == "resume":
            guest.resume()
            wire_.connect()
        print("ok", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tap-fd", type=int, required=True)
    parser.add_argument("--mac", required=True)
    parser.add_argument("--cmdline", required=True)
    parser.add_argument("--drive", type=Path, required=True)
    parser.add_argument("--scratch", type=Path, required=True)
    args = parser.parse_args()
    cable = Wire(args.tap_fd, make_nic(args.mac, args.cmdline))
    guest = Guest(args.drive, args.scratch)
    guest.start()
    cable.connect()
    print("ok", flush=True)
    obey(cable, guest)


if __name__ == "__main__":
    main()
