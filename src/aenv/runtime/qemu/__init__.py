"""The QEMU driver: `-M microvm`, KVM when it works and TCG otherwise, driven over QMP.

The package, from the bottom up: settings (`config`), platforms (`platform`), the command line
(`cmdline`), drives and layers (`disks`), what a driver's VMs share (`host`: `compat`, jail
uids), a VMM's process and state (`vmm`), saving (`save`), a running VM (`vm`), starting VMMs
in their jails and cgroups (`process`), restoring (`restore`), and the driver (`driver`) in
front of them.

What `research/feasibility.md` measured, applied:
- Guest memory is a file (`memory-backend-file`, always `id=mem` so RAM block names match across
  processes). A booted VM maps its own file `share=on`, so a snapshot with `x-ignore-shared` only
  has to write device state (~60 KiB); restored VMs map the snapshot's file `share=off`, so clean
  pages are shared by every clone through the page cache and writes stay private.
- A VM whose memory is such a private mapping cannot be saved that way (its RAM is not "shared" to
  QEMU). Its saves keep the file it maps as their memory and carry only the pages the guest
  changed in the state stream (`ramdelta`: found through the mapping's page map, the rest of
  QEMU's stream filtered out); restores map that file and load the changed pages over it.
  Pauses name the mapped file itself; snapshots and fork checkpoints, which outlive the
  sandbox and whose files are moved into directories of their own, get a hard link to it.
  (A stream the filter does not understand is kept whole: it loads over the base all the
  same.) `detach_memory` turns a state whose RAM travels in the stream with no memory file
  (`Snapshot.memory_file is None`, as earlier versions saved snapshots) into the
  mapped kind by loading it (without running the guest) and saving it again.
- Snapshot = stop, freeze writable disks (`blockdev-snapshot`: the current top becomes a
  sealed layer), migrate to the state file with the bandwidth cap lifted (7.2 defaults to
  32 MiB/s), then either continue or quit.
- Restore = spawn with `-incoming defer -S`, set the same capabilities, `migrate-incoming`, `cont`.
- State files are opened by us and passed to QEMU over QMP (`getfd`, `fd:` URIs): QEMU reads and
  writes them directly, ≈ 25% faster than `exec:cat` through a pipe for a 100 MiB stream.
  A changed-pages save is the exception: QEMU migrates into a pipe that `ramdelta` filters as
  it reads, which beats writing the whole stream to a file first (see `ramdelta`).
- Under TCG the guest kernel cannot calibrate its TSC and may hang at boot: we pass the host's TSC
  frequency as `tsc_early_khz`.
- The netdev type is part of the migration stream, so every VM uses a tap (never user-mode net).
  The tap is opened by us in the slot's namespace and passed in as a file (`aenv.network.tap`).
- Every QEMU runs jailed (`aenv.runtime.jail`: own uid, no capabilities, seccomp, only its own
  files) unless `QemuConfig.jail` is None, which is for benchmarks and debugging only.
"""

from __future__ import annotations

from aenv.runtime.qemu.cmdline import SHARE_FILE_MODES
from aenv.runtime.qemu.config import SHARE_SLOTS, TCG_TB_MIB, Accel, QemuConfig
from aenv.runtime.qemu.driver import QemuDriver
from aenv.runtime.qemu.platform import LEGACY_TCG_CPU, TCG_CPU, Platform, host_tsc_khz
from aenv.runtime.qemu.vm import QemuVM

__all__ = [
    "LEGACY_TCG_CPU",
    "SHARE_FILE_MODES",
    "SHARE_SLOTS",
    "TCG_CPU",
    "TCG_TB_MIB",
    "Accel",
    "Platform",
    "QemuConfig",
    "QemuDriver",
    "QemuVM",
    "host_tsc_khz",
]
