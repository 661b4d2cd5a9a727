"""Host resources a node keeps in reserve.

Creates and saves (pauses, snapshots, fork checkpoints) are refused while the free space of the
data directory's filesystem or the host's available memory (guest memory files live on tmpfs)
is under its reserve: a host that fills up then refuses requests with a clear error, instead of
failing writes half-way through a saved state or the catalog. Creates and forks also project the
disk their sandboxes can use (each one's writable layer is bounded at its disk size) and are
refused when it does not fit in the free space above the reserve.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil


@dataclass(frozen=True)
class HostReserve:
    path: Path  # on the filesystem whose free space counts
    disk_mb: int
    memory_mb: int

    def free_disk_mb(self) -> int:
        """Free space of the data filesystem. Blocking (a statfs): run it in a thread."""
        existing = next(p for p in (self.path, *self.path.parents) if p.exists())
        return shutil.disk_usage(existing).free >> 20

    def disk_shortfall(self, free_mb: int, need_mb: int) -> str | None:
        """Why sandboxes that can write `need_mb` do not fit in `free_mb` above the reserve, or
        None when they do."""
        room_mb = free_mb - self.disk_mb
        if need_mb <= room_mb:
            return None
        return (
            f"not enough disk: the sandboxes would use up to {need_mb} MiB, the host's free disk "
            f"above its reserve is {max(room_mb, 0)} MiB ({free_mb} MiB free, "
            f"{self.disk_mb} MiB reserved)"
        )

    def shortfall(self) -> str | None:
        """What is under its reserve now, or None. Blocking (a statfs): run it in a thread."""
        free_mb = self.free_disk_mb()
        if free_mb < self.disk_mb:
            return f"the host's free disk ({free_mb} MiB) is under its reserve ({self.disk_mb} MiB)"
        available_mb = psutil.virtual_memory().available >> 20
        if available_mb < self.memory_mb:
            return (
                f"the host's available memory ({available_mb} MiB) is under its reserve "
                f"({self.memory_mb} MiB)"
            )
        return None
