"""Host resources a node keeps in reserve.

Creates and saves (pauses, snapshots, fork checkpoints) are refused while the free space of the
data directory's filesystem or the host's available memory (guest memory files live on tmpfs)
is under its reserve: a host that fills up then refuses requests with a clear error, instead of
failing writes half-way through a saved state or the catalog.
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

    def shortfall(self) -> str | None:
        """What is under its reserve now, or None. Blocking (a statfs): run it in a thread."""
        existing = next(p for p in (self.path, *self.path.parents) if p.exists())
        free_mb = shutil.disk_usage(existing).free >> 20
        if free_mb < self.disk_mb:
            return f"the host's free disk ({free_mb} MiB) is under its reserve ({self.disk_mb} MiB)"
        available_mb = psutil.virtual_memory().available >> 20
        if available_mb < self.memory_mb:
            return (
                f"the host's available memory ({available_mb} MiB) is under its reserve "
                f"({self.memory_mb} MiB)"
            )
        return None
