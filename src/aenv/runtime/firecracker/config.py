"""Host-wide settings of the Firecracker driver: which binaries, the jailer option, which devices
every VM gets (balloon, entropy, vsock, MMDS), rate limits, and default resource limits.

The defaults suit one machine with KVM: unjailed Firecracker from PATH, dirty-page tracking on
(incremental snapshots), a balloon that reports free pages back to the host, virtio-rng.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from aenv.runtime.firecracker import models as m
from aenv.runtime.firecracker.jailer import JailerConfig
from aenv.runtime.jail import JailConfig

# Firecracker's own use beyond guest memory (VMM heap, device queues, API server), generous so
# the cgroup limit bites on a runaway VMM rather than on a healthy one.
DEFAULT_VMM_OVERHEAD_MIB = 64
# Threads of one Firecracker: main/API, one per vCPU, and a few for I/O engines and signals.
DEFAULT_PIDS_BASE = 16


def default_balloon() -> m.Balloon:
    # No inflation target: the balloon exists for free page reporting (idle sandboxes give memory
    # back) and for the guest memory statistics, polled every few seconds (statistics cannot be
    # switched on after boot, so they are on from the start); deflate_on_oom keeps a target from
    # killing work.
    return m.Balloon(
        amount_mib=0, deflate_on_oom=True, stats_polling_interval_s=5, free_page_reporting=True
    )


@dataclass(frozen=True)
class FirecrackerConfig:
    binary: Path = Path("firecracker")
    jailer: JailerConfig | None = None
    # With a jailer: each VM's jailer gets a uid of its own from this range, and the range's
    # group (`aenv.runtime.jail`), instead of the jailer config's one uid and gid for all.
    jail_uids: JailConfig | None = None
    # Diff snapshots of exactly the pages written since the last snapshot or restore. KVM dirty
    # logging costs some guest write throughput, and PVM hosts do not support it.
    track_dirty_pages: bool = True
    balloon: m.Balloon | None = field(default_factory=default_balloon)
    entropy: m.EntropyDevice | None = field(default_factory=m.EntropyDevice)
    # virtio-vsock for a host<->guest channel, listening at `<workdir>/vsock.sock`.
    vsock_cid: int | None = None
    # MMDS on the guest NIC (needs a network attachment); its data store is not part of a
    # snapshot, so `FirecrackerVM.put_metadata` must be called again after each restore.
    mmds_version: m.MmdsVersion | None = None
    disk_rate_limiter: m.RateLimiter | None = None
    net_rx_rate_limiter: m.RateLimiter | None = None
    net_tx_rate_limiter: m.RateLimiter | None = None
    io_engine: m.IoEngine | None = None
    log_level: m.LogLevel = "Warning"
    vmm_overhead_mib: int = DEFAULT_VMM_OVERHEAD_MIB
    pids_base: int = DEFAULT_PIDS_BASE
    # Unjailed VMMs get their cgroup from `aenv.runtime.cgroups` under this parent.
    cgroup_parent: str = "aenv-firecracker"
    # VM ids are `<id_prefix><16 hex digits>`: Firecracker's `--id`, the jailer's `--id`, the
    # cgroup and the jail directory. The startup sweep (`aenv.runtime.sweep`) recognises our VMMs
    # and their leftovers by this prefix, so it must start with the sweep's prefix (`aenv-`).
    id_prefix: str = "aenv-fc-"
    ready_timeout_s: float = 10.0
    extra_args: tuple[str, ...] = ()
