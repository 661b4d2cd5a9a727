"""Admission of creates by the host's real memory, not by a count of sandboxes.

Two limits, both checked before anything starts:
1. The host's available memory (MemAvailable) minus the configured reserve must hold what the
   creates already starting will take, plus this one. A restored guest maps its template's
   memory and touches few pages, so each is counted at `create_mb` (its host cost), not at its
   nominal guest RAM.
2. The nominal guest RAM of every VM the node runs, plus this one, must stay within
   `overcommit` times the host's RAM: guests that all wake up and touch their memory at once
   must not have been promised more than that.
A refusal names which limit and the figures, so a client's 429 says why.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import psutil


class Refusal(enum.StrEnum):
    """Why a create was refused (the metrics label)."""

    SANDBOXES = "sandboxes"  # the node's count cap
    TEAM = "team"  # the team's caps (sandboxes at once, disk)
    DISK = "disk"
    MEMORY = "memory"  # available memory
    OVERCOMMIT = "overcommit"  # nominal guest RAM


@dataclass(frozen=True)
class HostMemory:
    available_mb: int
    total_mb: int

    @classmethod
    def now(cls) -> HostMemory:
        memory = psutil.virtual_memory()
        return cls(memory.available >> 20, memory.total >> 20)


@dataclass(frozen=True)
class MemoryBudget:
    reserve_mb: int
    create_mb: int
    overcommit: float

    def refusal(
        self, host: HostMemory, *, starting: int, nominal_mb: int, need_mb: int
    ) -> tuple[Refusal, str] | None:
        """Why one more VM of `need_mb` guest RAM does not fit, with `starting` creates under
        way and `nominal_mb` of guest RAM running, or None when it fits."""
        room_mb = host.available_mb - self.reserve_mb - starting * self.create_mb
        if room_mb < self.create_mb:
            return Refusal.MEMORY, (
                f"not enough memory: the host has {host.available_mb} MiB available, "
                f"{self.reserve_mb} MiB of it reserved and {starting * self.create_mb} MiB "
                f"counted for {starting} creates under way; a new sandbox needs "
                f"{self.create_mb} MiB"
            )
        limit_mb = int(host.total_mb * self.overcommit)
        if nominal_mb + need_mb > limit_mb:
            return Refusal.OVERCOMMIT, (
                f"memory overcommit limit reached: sandboxes hold {nominal_mb} MiB of guest "
                f"memory, a new one needs {need_mb} MiB, the limit is {limit_mb} MiB "
                f"({self.overcommit:g} x the host's {host.total_mb} MiB)"
            )
        return None
