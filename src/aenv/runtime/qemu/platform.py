"""What a VM's saved state depends on besides its spec: the CPU model and machine a VMM emulates
(`Platform`), which of them a driver boots and still restores (`platforms`), and the host facts
they are named with (QEMU's version, the host's CPU model and TSC frequency)."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from pathlib import Path

from aenv.runtime.driver import DriverError

UNNAMED_MACHINE = "microvm,x-option-roms=off,rtc=on"  # of snapshots whose compat names none
# The CPU of TCG guests: all TCG emulates, but 4-level paging. Given LA57 the guest kernel uses
# 5-level page tables: one more level for every page walk of the emulated MMU, and TCG walks on
# every miss of its software TLB, which it flushes whole at every address-space switch. The
# same guest work costs 6% less host CPU without it (bench/guest_cpu.py), 14% over a longer
# run of SDK commands on one sandbox (docs/benchmarks.md). Guests keep 128 TiB of user space.
TCG_CPU = "max,la57=off"
LEGACY_TCG_CPU = "max"  # of snapshots taken before 2026-12-05


@dataclass(frozen=True)
class Platform:
    """What the state of a VM depends on besides its spec: the CPU model its VMM emulates (or
    passes through) and the machine with its devices. A snapshot restores only on the platform
    it was taken on (its `compat` names it), so a driver keeps restoring older ones."""

    cpu: str
    machine: str


def platforms(accel: str) -> tuple[Platform, ...]:
    """The platforms `accel` restores, newest (the one it boots) first."""
    if accel != "tcg":
        return (Platform("host", machine(accel)), Platform("host", UNNAMED_MACHINE))
    return (
        Platform(TCG_CPU, machine(accel)),
        Platform(LEGACY_TCG_CPU, machine(accel)),
        Platform(LEGACY_TCG_CPU, UNNAMED_MACHINE),
    )


def machine(accel: str) -> str:
    """The machine and its devices; a snapshot restores only on the same (its `compat` names
    them). Under TCG without the PIT: nothing in the guest uses it (the local APIC is its
    timer), yet QEMU emulated its default 18.2 Hz square wave, waking every VMM's main loop
    36 times a second (most of an idle sandbox's host CPU once the guest itself was quiet,
    docs/density.md). Under KVM the PIT is in the kernel and costs the host no wakeups."""
    pit = ",pit=off" if accel == "tcg" else ""
    return f"microvm,x-option-roms=off,rtc=on{pit}"


async def qemu_version(binary: str) -> str:
    """The version `binary --version` reports, "unknown" if it reports none."""
    proc = await asyncio.create_subprocess_exec(binary, "--version", stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    match = re.search(r"version (\S+)", out.decode())
    return match.group(1) if match else "unknown"


def host_tsc_khz(cpuinfo: str | None = None) -> int:
    """The host TSC frequency in kHz, from the first `cpu MHz` line of /proc/cpuinfo. TCG guests
    read the host's TSC directly, so this is the frequency their kernel must assume. (`cpu MHz` is
    the TSC rate on constant-TSC hosts without frequency scaling, such as cloud VMs.)"""
    text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    match = re.search(r"^cpu MHz\s*:\s*([0-9.]+)", text, re.MULTILINE)
    if not match:
        raise DriverError("cannot read the host TSC frequency from /proc/cpuinfo")
    return int(float(match.group(1)) * 1000)


def host_cpu_model() -> str:
    match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    return match.group(1).strip() if match else "unknown"
