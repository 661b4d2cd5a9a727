"""What the VMs of one driver share (`Host`): its settings, the `compat` their snapshots are
named with, whether `ramdelta` understands this QEMU's streams, and the uids of their jails."""

from __future__ import annotations

import asyncio

from aenv.runtime.jail import Jail, UidPool
from aenv.runtime.qemu.config import QemuConfig
from aenv.runtime.qemu.platform import UNNAMED_MACHINE, Platform, host_cpu_model, qemu_version

DRIVER_NAME = "qemu"


class Host:
    def __init__(self, config: QemuConfig) -> None:
        self.config = config
        self._uids = UidPool(config.jail) if config.jail is not None else None
        self._compat: str | None = None
        self._host_cpu = "host"  # under KVM, named with the host's model in `compat`
        # Whether `ramdelta` understood a stream of this QEMU (see `save.save_delta`).
        self.streams_understood = False

    async def compat_on(self, platform: Platform) -> str:
        """The `compat` of a snapshot taken on `platform` (a VM restored on an older one keeps
        it, and so do its snapshots)."""
        if self._compat is None:
            version = await qemu_version(self.config.binary)
            if self.config.accel == "kvm":
                self._host_cpu = f"host:{await asyncio.to_thread(host_cpu_model)}"
            self._compat = f"qemu-{version}/{self.config.accel}"
        cpu = platform.cpu if self.config.accel == "tcg" else self._host_cpu
        named = "" if platform.machine == UNNAMED_MACHINE else f"/{platform.machine}"
        return f"{self._compat}/{cpu}{named}"

    def new_jail(self) -> Jail | None:
        """A jail with a uid of its own, None when VMMs run unconfined."""
        if self.config.jail is None or self._uids is None:
            return None
        return Jail(self._uids.acquire(), self.config.jail.gid, kvm=self.config.accel == "kvm")

    def release(self, jail: Jail | None) -> None:
        """Give the uid of a jail whose process has exited back."""
        if jail is not None and self._uids is not None:
            self._uids.release(jail.uid)
