"""Starting VMM processes (`Launcher`): each in its own jail and cgroup, on a tap opened for it,
connected to its QMP monitor before its guest runs; and which of them are still owned, for the
sweeps (`sweep.reap_unowned`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import weakref
from collections.abc import Sequence
from pathlib import Path

from aenv.network.tap import open_tap
from aenv.runtime.cgroups import Cgroup, CgroupLimits, CgroupManager
from aenv.runtime.driver import DriverError, VMSpec
from aenv.runtime.jail import Jail
from aenv.runtime.qemu import cmdline
from aenv.runtime.qemu.cmdline import Memory
from aenv.runtime.qemu.config import QemuConfig
from aenv.runtime.qemu.disks import unlink
from aenv.runtime.qemu.host import Host
from aenv.runtime.qemu.platform import Platform
from aenv.runtime.qemu.vm import QemuVM, tail
from aenv.runtime.qmp import Monitor
from aenv.runtime.sweep import VMM_NAME_PREFIX, reap_unowned
from aenv.timing import Steps

# QEMU's own memory besides the guest's and the translation cache: heap, device state, buffers,
# libraries and the cache's bookkeeping (25-35 MiB measured, docs/density.md), with room.
VMM_OVERHEAD_MIB = 144
DEFAULT_PIDS = 64
_JAIL_ENV = {"PATH": "/usr/bin:/bin"}


class Launcher:
    """Starts the VMMs of one driver and knows which of them some VM object still stands for."""

    def __init__(self, host: Host, cgroups: CgroupManager | None) -> None:
        self.host = host
        self.config = host.config
        self.cgroups = cgroups
        # Every VM handed out and still referenced by someone: a VMM whose VM object is gone
        # without a stop has no owner left (see `sweep.reap_unowned`).
        self._vms: weakref.WeakValueDictionary[str, QemuVM] = weakref.WeakValueDictionary()
        self._launching: set[str] = set()

    def owned_vmm_names(self) -> set[str]:
        """The `-name` of every VMM being launched or that some VM object of this driver still
        stands for. Safe to call from another thread: a launch is in one set or the other at
        every moment, and a copy taken while the event loop changes them is taken again."""
        while True:
            try:
                ids = [*self._launching.copy(), *self._vms.keys()]
            except RuntimeError:  # changed size during the copy
                continue
            return {f"{VMM_NAME_PREFIX}{vm_id}" for vm_id in ids}

    @staticmethod
    def cgroup_name(vmm_name: str) -> str:
        return f"qemu-{vmm_name.removeprefix(VMM_NAME_PREFIX)}"

    def reap_unowned(self) -> list[str]:
        """Implements `sweep.Reaper`. Blocking."""
        gc.collect()  # a VM object dropped in a reference cycle is gone only after this
        return reap_unowned(self.owned_vmm_names, self.cgroups, self.cgroup_name)

    async def launch(
        self,
        vm_id: str,
        spec: VMSpec,
        memory: Memory,
        error: type[DriverError],
        *,
        platform: Platform,
        incoming: bool,
        steps: Steps,
    ) -> QemuVM:
        """A QEMU process for `spec` on `platform`, its vCPUs not started: a boot, or waiting
        for an incoming state when `incoming`. The time of each step goes into `steps`. Raises
        `error`; a launch that fails leaves nothing it made: no process, cgroup, QMP socket,
        memory file it owned, or jail uid taken."""
        if not await asyncio.to_thread(spec.workdir.is_dir):
            raise error(f"workdir {spec.workdir} does not exist")
        stderr_log = spec.workdir / f"qemu.{vm_id}.log"
        try:
            return await self._launch(vm_id, spec, memory, platform, incoming, steps)
        except Exception as exc:
            raise error(f"cannot start QEMU: {exc}; {tail(stderr_log)}") from exc

    async def _launch(
        self,
        vm_id: str,
        spec: VMSpec,
        memory: Memory,
        platform: Platform,
        incoming: bool,
        steps: Steps,
    ) -> QemuVM:
        """`launch`, each step's undo pushed as soon as it is done: a step that fails undoes
        those before it, in reverse order."""
        qmp_path = spec.workdir / f"qmp.{vm_id}.sock"
        console = spec.workdir / f"console.{vm_id}.log"
        stderr_log = spec.workdir / f"qemu.{vm_id}.log"
        monitor = Monitor(qmp_path, f"aenv-{vm_id}")
        async with contextlib.AsyncExitStack() as undo:
            jail = self.host.new_jail()
            undo.callback(self.host.release, jail)
            self._launching.add(vm_id)
            undo.callback(self._launching.discard, vm_id)
            if memory.owned:  # made by `_confine`, or by QEMU
                undo.callback(unlink, [memory.path])
            # What the launch holds only until QEMU runs: the tap's fd (QEMU has its own copy
            # then) and the jail's namespaces (QEMU has joined them).
            async with contextlib.AsyncExitStack() as held:
                tap_fd: int | None = None
                if spec.net is not None:
                    tap_fd = await open_tap(spec.net.netns, spec.net.tap)
                    held.callback(os.close, tap_fd)
                steps.mark("tap")
                fd = -1 if tap_fd is None else tap_fd
                argv = await asyncio.to_thread(
                    cmdline.argv,
                    self.config,
                    vm_id,
                    spec,
                    memory,
                    qmp_path,
                    console,
                    fd,
                    platform,
                    incoming,
                )
                if incoming:
                    argv += ["-incoming", "defer"]
                cgroup: Cgroup | None = None
                if self.cgroups is not None:
                    # Made before QEMU starts, so that it is removed after QEMU has ended.
                    cgroup = await asyncio.to_thread(
                        self.cgroups.create,
                        self.cgroup_name(f"{VMM_NAME_PREFIX}{vm_id}"),
                        limits(self.config, spec, memory),
                    )
                    undo.push_async_callback(asyncio.to_thread, cgroup.remove)
                steps.mark("cgroup")
                undo.push_async_callback(monitor.close)  # also right for one never listening
                await monitor.listen()
                if jail is not None:
                    argv = await _confine(held, jail, argv, spec, memory, qmp_path, console)
                steps.mark("jail")
                proc = await _spawn(
                    argv, stderr_log, tap_fd, clean_env=jail is not None, shares=bool(spec.shares)
                )
                undo.push_async_callback(_kill, proc)
                steps.mark("spawn")
                if cgroup is not None:
                    # Placed before the guest runs (-S): vCPU threads and helpers inherit it.
                    await asyncio.to_thread(cgroup.add, proc.pid)
                # Connected means QEMU is running inside the jail: the jail may be let go.
                await monitor.accept(proc, self.config.start_timeout_s)
                steps.mark("qmp")
            vm = QemuVM(
                vm_id=vm_id,
                host=self.host,
                platform=platform,
                spec=spec,
                proc=proc,
                monitor=monitor,
                memory=memory,
                cgroup=cgroup,
                jail=jail,
                console_log=console,
                stderr_log=stderr_log,
            )
            self._vms[vm_id] = vm
            undo.pop_all()
        self._launching.discard(vm_id)  # only now: a reaper thread sees it owned all along
        return vm


async def _confine(
    held: contextlib.AsyncExitStack,
    jail: Jail,
    argv: list[str],
    spec: VMSpec,
    memory: Memory,
    qmp: Path,
    console: Path,
) -> list[str]:
    """`argv` run inside `jail`, whose namespaces `held` keeps until QEMU has joined them."""
    # Files QEMU would create itself are made first, so that they can be given to it.
    made = [console, memory.path] if memory.owned else [console]
    await asyncio.to_thread(_touch, made)
    files = await asyncio.to_thread(cmdline.jail_files, spec, memory, qmp, console)
    return [*await held.enter_async_context(jail.assemble(files)), *argv]


async def _kill(proc: asyncio.subprocess.Process) -> None:
    """End a VMM that was never handed out, and any helper in its process group."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


def limits(config: QemuConfig, spec: VMSpec, memory: Memory) -> CgroupLimits:
    lim = spec.limits
    tb_mib = config.tb_size_mib if config.accel == "tcg" else 0
    memory_mib = lim.memory_max_mib or memory_cap_mib(spec.memory_mib, memory.shared, tb_mib)
    return CgroupLimits(
        memory_bytes=memory_mib << 20,
        pids=lim.pids_max or DEFAULT_PIDS,
        cpu_cores=lim.cpu_cores or float(spec.vcpus),
    )


def memory_cap_mib(guest_mib: int, shared: bool, tb_mib: int) -> int:
    """What a VMM's cgroup may hold. A VMM owning its memory file holds the guest's RAM once
    (the file's tmpfs pages) besides its own overhead and translation cache (`tb_mib`). One
    mapping a base file privately can be charged for the guest's RAM three times over, each
    bounded by the guest's size: its private copies of the pages the guest wrote; the pages
    tmpfs allocates in the base file where the guest touched a hole (a private mapping of a
    sparse tmpfs file fills the hole before copying it, and the filled page stays in the file,
    unreclaimable without swap); and while it saves changed pages, the stream it writes into
    tmpfs scratch (`save_delta`: the first such save of a server; later ones stream through a
    pipe, but any VMM may be first). A cap of guest + overhead killed such VMMs once their guest
    had written most of its RAM."""
    return (1 if shared else 3) * guest_mib + VMM_OVERHEAD_MIB + tb_mib


async def _spawn(
    argv: Sequence[str], stderr_log: Path, tap_fd: int | None, *, clean_env: bool, shares: bool
) -> asyncio.subprocess.Process:
    with stderr_log.open("wb") as err:
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,  # one process group: kill takes any helper too
            pass_fds=() if tap_fd is None else (tap_fd,),
            # A jailed VMM gets none of the server's environment (it may hold credentials).
            env=_JAIL_ENV if clean_env else None,
            # Files a VMM creates in a share get exactly `SHARE_FILE_MODES` (see `cmdline`).
            umask=0 if shares else -1,
        )


def _touch(paths: Sequence[Path]) -> None:
    for p in paths:
        p.touch()
