"""The guest boot contract: kernel command-line parameters and disk labels our init understands.

Disks are found by filesystem label, not by device order, so a driver may attach them in any order:
the template base (`aenv-root`, read-only), the sandbox's writable layer (`aenv-upper`; without it
changes live in guest RAM) and the envd bundle (`aenv-envd`, mounted read-only at `/opt/aenv`).
Every guest gets the same fixed IP; the host tells it through `aenv.ip` / `aenv.gw` / `aenv.dns`.
"""

from __future__ import annotations

from dataclasses import dataclass

ROOT_LABEL = "aenv-root"
UPPER_LABEL = "aenv-upper"
ENVD_LABEL = "aenv-envd"
READY_MARKER = "aenv-init: ready"

# panic=-1 reboots at once on panic, which a VMM run with no-reboot turns into an exit we see.
_BASE = (
    "console=ttyS0",
    "panic=-1",
    "quiet",
    "i8042.noaux",
    "i8042.nomux",
    "i8042.nopnp",
    # Idle guests must cost (next to) nothing on the host: no clocksource watchdog (a timer
    # every 0.5 s checking the TSC) and no soft-lockup watchdog (an hrtimer per CPU).
    "tsc=reliable",
    "nowatchdog",
    # No pressure stall information: its averaging work runs every 2 s (bench/wakeups.py), and
    # nothing in a sandbox reads /proc/pressure.
    "psi=0",
)


@dataclass(frozen=True)
class GuestNet:
    address: str  # CIDR, e.g. 10.0.2.15/24
    gateway: str
    dns: str | None = None


def kernel_cmdline(
    net: GuestNet | None = None, hostname: str | None = None, extra: tuple[str, ...] = ()
) -> str:
    parts = list(_BASE)
    if net is not None:
        parts += [f"aenv.ip={net.address}", f"aenv.gw={net.gateway}"]
        if net.dns:
            parts.append(f"aenv.dns={net.dns}")
    if hostname:
        parts.append(f"aenv.hostname={hostname}")
    parts += extra
    return " ".join(parts)
