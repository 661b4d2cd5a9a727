"""The Firecracker VMM driver: typed REST API models (`models`), the unix-socket client (`api`),
process and jailer handling (`process`, `jailer`, `placement`), memory-file merging (`memfile`),
host facts (`host`), settings (`config`), and the `aenv.runtime.driver` implementation: the driver
(`driver`: boot, restore, clones) and its VMs (`vm`: pause, resume, snapshot, stop, stats).
"""

from __future__ import annotations

from aenv.runtime.driver import Driver
from aenv.runtime.firecracker.config import FirecrackerConfig
from aenv.runtime.firecracker.driver import FirecrackerDriver


def create_driver(config: FirecrackerConfig | None = None) -> Driver:
    """The driver, typed as the shared interface (what driver selection hands out)."""
    return FirecrackerDriver(config)


__all__ = [
    "FirecrackerConfig",
    "FirecrackerDriver",
    "create_driver",
]
