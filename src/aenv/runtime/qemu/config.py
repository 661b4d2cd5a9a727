"""The QEMU driver's settings (`QemuConfig`) and the defaults they start from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from aenv.runtime.jail import JailConfig

Accel = Literal["kvm", "tcg"]
# TCG translation cache per VMM, in MiB. QEMU 7.2 defaults to 1 GiB (of which an idle guest
# fills a few MiB); a bound keeps a guest that runs much code from holding more. When it is
# full QEMU drops all of it and translates the guest's code again: 32 made an agent-like
# workload 3x slower, and 48 (the default until 2026-12-05) still cost a used sandbox 9% more
# host CPU than 128 on shells and Python starts (bench/guest_cpu.py), 18% over a longer run of
# SDK commands (docs/benchmarks.md). A fresh sandbox uses 22-26 MiB whatever the bound; a used
# one fills it (docs/density.md).
TCG_TB_MIB = 128
# Share devices every booted VM gets (`VMSpec.share_slots`), so that sandboxes restored from its
# snapshots can mount that many volumes: a create with volumes is a restore, not a boot. QEMU
# refuses to save a VM while a 9p export is mounted, not while one is only present. Each slot
# is a virtio-mmio device of its own (microvm has 24 with its second IOAPIC) and costs each
# VMM ≈ 1.2 MiB (4 slots: USS +5.0 MiB, bench/vmm_memory.py): 2 cover the common case.
SHARE_SLOTS = 2


@dataclass(frozen=True)
class QemuConfig:
    accel: Accel = "tcg"
    binary: str = "qemu-system-x86_64"
    start_timeout_s: float = 30.0
    migrate_timeout_s: float = 120.0
    # None runs QEMU unconfined (as root, with the host's files in view): benchmarks only.
    jail: JailConfig | None = field(default_factory=JailConfig)
    # Off keeps what a guest frees allocated on the host: benchmarks only.
    discard: bool = True
    # TCG only: the translation cache's size (`-accel tcg,tb-size=`), in MiB.
    tb_size_mib: int = TCG_TB_MIB
    # Share devices of every booted VM (see `SHARE_SLOTS`).
    share_slots: int = SHARE_SLOTS
