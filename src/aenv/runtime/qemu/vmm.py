"""The process side of one VM (`Vmm`): the QEMU process, its monitor, memory file, cgroup and
jail, the files it owns, and its run state; what `save` works on and `vm.QemuVM` runs."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from aenv.runtime.cgroups import Cgroup
from aenv.runtime.driver import VMSpec, VMState
from aenv.runtime.jail import Jail
from aenv.runtime.qemu.cmdline import Memory
from aenv.runtime.qemu.host import Host
from aenv.runtime.qemu.platform import Platform
from aenv.runtime.qmp import Monitor, MonitorError


class Vmm:
    """One QEMU process and what it holds."""

    def __init__(
        self,
        *,
        vm_id: str,
        host: Host,
        platform: Platform,
        spec: VMSpec,
        proc: asyncio.subprocess.Process,
        monitor: Monitor,
        memory: Memory,
        cgroup: Cgroup | None,
        jail: Jail | None,
        console_log: Path,
        stderr_log: Path,
    ) -> None:
        self._id = vm_id
        self.host = host
        self.platform = platform
        self.spec = spec
        self.proc = proc
        self.monitor = monitor
        self.memory = memory
        self.cgroup = cgroup
        self.jail = jail
        self._console = console_log
        self.stderr_log = stderr_log
        self.run_state = VMState.PAUSED
        self.owned_files: list[Path] = []  # private writable layers created for this VM
        # The saved states whose memory this VM was restored from over its mapped file, oldest
        # first: its next save keeps only what differs from them (`ramlayers`).
        self.ram_layers: tuple[Path, ...] = ()
        self.lock = asyncio.Lock()  # held by each operation on the VM
        self.generation = 0  # of its drives' tops: one more each time they are stacked anew

    @property
    def id(self) -> str:
        return self._id

    @property
    def state(self) -> VMState:
        if self.proc.returncode is not None:
            return VMState.STOPPED
        return self.run_state

    @property
    def console_log(self) -> Path:
        return self._console

    @property
    def share_slots(self) -> int:
        return self.spec.share_slots

    async def quit(self) -> None:
        """Ask QEMU to quit, and wait until it has."""
        with contextlib.suppress(MonitorError):
            await self.monitor.execute("quit")
        await self.proc.wait()
