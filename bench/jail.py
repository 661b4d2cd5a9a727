"""What the VMM jail costs: the same operations with the jail and without, in one run.

One template is booted and snapshotted; then, alternating between a jailed QEMU driver and one
with the jail off (`QemuConfig(jail=None)`, its only difference), each run measures:
- restore: to the VMM running, and to the guest agent answering;
- create -> first command: restore, then the agent runs `true` in the guest and answers;
- pause: QMP stop of a running VM (vCPUs halted; the median of `STOPS` stops per run, a single
  one is too short to compare), and pause to disk (a snapshot that stops the VM, what a sandbox
  pause does);
- CPU per create: this process's CPU (user + system, its threads and the helpers it waits for)
  spent on restore + first command, and the VMM's own CPU until the first command answered.
Ratios are jailed / unjailed medians (target <= 1.1). The guest agent stands in for envd (see
tests/runtime/qemu_vm/agent.py). Prints one JSON document on stdout; progress goes to stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from summary import summary_ms  # noqa: E402
from vm_env import vm_env  # noqa: E402

from aenv.guest.cmdline import kernel_cmdline  # noqa: E402
from aenv.runtime.driver import Disk, RestoreSpec, Snapshot, SnapshotTarget, VMSpec  # noqa: E402
from aenv.runtime.qemu import QemuConfig, QemuDriver, QemuVM  # noqa: E402
from aenv.storage import layers  # noqa: E402
from tests.runtime.qemu_vm.netns import GUEST_NET, NetnsPool, agent, wait_ready  # noqa: E402

RUNS = int(os.environ.get("AENV_BENCH_RUNS", "10"))
STOPS = 20
MEMORY_MIB = 256
MODES = ("jailed", "unjailed")
SAMPLES = ("running", "ready", "first_command", "pause", "pause_to_disk", "cpu_host", "cpu_vmm")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def host_cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


class Places:
    def __init__(self, work: Path, shm: Path, nets: NetnsPool) -> None:
        self.work, self.shm, self.nets = work, shm, nets
        self.count = 0

    def fresh(self, root: Path) -> Path:
        self.count += 1
        path = root / f"d{self.count}"
        path.mkdir()
        return path

    def target(self) -> RestoreSpec:
        return RestoreSpec(self.fresh(self.work), net=self.nets.create(), memory_dir=self.shm)

    def snapshot_target(self) -> SnapshotTarget:
        return SnapshotTarget(self.fresh(self.work), self.fresh(self.shm))


async def template(driver: QemuDriver, p: Places, images: dict[str, Path]) -> Snapshot:
    workdir = p.fresh(p.work)
    upper = await layers.new_upper(workdir / "upper.img", 1024)
    net = p.nets.create()
    spec = VMSpec(
        vcpus=1, memory_mib=MEMORY_MIB, kernel=images["kernel"], initrd=images["initrd"],
        cmdline=kernel_cmdline(GUEST_NET), workdir=workdir, net=net, memory_dir=p.shm,
        disks=(Disk("root", images["rootfs"], read_only=True), Disk("upper", upper),
               Disk("envd", images["bundle"], read_only=True)),
    )  # fmt: skip
    vm = await driver.boot(spec)
    try:
        await wait_ready(net.netns)
        return await vm.snapshot(p.snapshot_target(), keep_running=False)
    finally:
        await vm.stop()


async def run_in_guest(netns: str, argv: list[str], timeout_s: float) -> None:
    """Run `argv` in the guest through the agent; raises unless it exits 0."""
    body = json.dumps({"argv": argv, "timeout": timeout_s}).encode()
    result = await agent(netns, "POST", "/run", body=body, limit_s=timeout_s + 20)
    if result["rc"] != 0:
        raise RuntimeError(f"{argv}: {result}")


def vmm_cpu(vm: QemuVM) -> float:
    """The host CPU (user + system) the VMM has spent so far, in seconds."""
    times = psutil.Process(vm.proc.pid).cpu_times()
    return float(times.user + times.system)


async def one_run(driver: QemuDriver, p: Places, snap: Snapshot) -> dict[str, float]:
    target = p.target()
    assert target.net is not None
    netns = target.net.netns
    cpu0, start = host_cpu(), time.perf_counter()
    vm = await driver.restore(snap, target)
    out = {"running": time.perf_counter() - start}
    try:
        await wait_ready(netns)
        out["ready"] = time.perf_counter() - start
        await agent(netns, "POST", "/run", body=json.dumps({"argv": ["true"]}).encode())
        out["first_command"] = time.perf_counter() - start
        out["cpu_host"] = host_cpu() - cpu0
        assert isinstance(vm, QemuVM)
        out["cpu_vmm"] = vmm_cpu(vm)
        stops = []
        for _ in range(STOPS):
            stop = time.perf_counter()
            await vm.pause()
            stops.append(time.perf_counter() - stop)
            await vm.resume()
        out["pause"] = statistics.median(stops)
        stop = time.perf_counter()
        await vm.snapshot(p.snapshot_target(), keep_running=False)
        out["pause_to_disk"] = time.perf_counter() - stop
    finally:
        await vm.stop()
    return out


async def measure(drivers: dict[str, QemuDriver], p: Places, snap: Snapshot) -> dict[str, Any]:
    samples: dict[str, dict[str, list[float]]] = {m: {k: [] for k in SAMPLES} for m in MODES}
    for run in range(RUNS):
        # Alternate which goes first, so that neither always runs on a warmer host.
        for mode in MODES if run % 2 == 0 else MODES[::-1]:
            for key, value in (await one_run(drivers[mode], p, snap)).items():
                samples[mode][key].append(value)
        log(f"run {run + 1}/{RUNS}")
    return samples


async def main() -> dict[str, Any]:
    async with vm_env() as env:
        accel = env.accel
        drivers = {
            "jailed": QemuDriver(QemuConfig(accel=accel), cgroups=env.cgroups),
            "unjailed": QemuDriver(QemuConfig(accel=accel, jail=None), cgroups=env.cgroups),
        }
        p = Places(env.work, env.shm, env.nets)
        snap = await template(drivers["jailed"], p, env.images)
        samples = await measure(drivers, p, snap)

    def ratio(key: str) -> float:
        jailed, unjailed = (statistics.median(samples[m][key]) for m in MODES)
        return round(float(jailed / unjailed), 3)

    return {
        "accel": accel,
        "guest_memory_mib": MEMORY_MIB,
        "runs": RUNS,
        "ms": {m: {k: summary_ms(samples[m][k]) for k in SAMPLES} for m in MODES},
        "ratio_jailed_to_unjailed": {k: ratio(k) for k in SAMPLES},
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main()), indent=2))
