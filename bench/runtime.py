"""microVM runtime benchmarks with the QEMU driver (TCG here, KVM with AENV_BENCH_ACCEL=kvm).

Every figure is min / median / max over several runs, and lifecycle figures are also given as a
ratio to the cold boot measured in the same run:
- cold boot to agent ready, then on the same VM: snapshot keeping it running, and the template
  snapshot (VM stops; device state only);
- restore one VM to agent ready; pause; resume;
- N clones restored at once to all ready (total and per child);
- PSS per idle clone vs PSS of a cold-booted VM, and the memory saved vs N independent boots.

The guest agent stands in for envd on the envd bundle drive (see tests/runtime/qemu_vm/agent.py).
Prints one JSON document on stdout; progress goes to stderr.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from summary import summary_ms  # noqa: E402
from vm_env import vm_env  # noqa: E402

from aenv.guest.cmdline import kernel_cmdline  # noqa: E402
from aenv.runtime.driver import VM, Disk, RestoreSpec, Snapshot, SnapshotTarget, VMSpec  # noqa: E402
from aenv.runtime.qemu import QemuConfig, QemuDriver  # noqa: E402
from aenv.storage import layers  # noqa: E402
from tests.runtime.qemu_vm.netns import GUEST_NET, NetnsPool, agent, wait_ready  # noqa: E402

RUNS = int(os.environ.get("AENV_BENCH_RUNS", "5"))
CLONES = int(os.environ.get("AENV_BENCH_CLONES", "16"))
MEMORY_MIB = 256


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def timed(op: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = await op()
    return time.perf_counter() - start, result


class Bench:
    def __init__(self, work: Path, shm: Path, driver: QemuDriver, nets: NetnsPool) -> None:
        self.work, self.shm, self.driver, self.nets = work, shm, driver, nets
        self.count = 0

    def fresh(self, root: Path, prefix: str) -> Path:
        self.count += 1
        path = root / f"{prefix}{self.count}"
        path.mkdir()
        return path

    def target(self) -> RestoreSpec:
        return RestoreSpec(workdir=self.fresh(self.work, "vm"), net=self.nets.create(),
                           memory_dir=self.shm)  # fmt: skip

    def snapshot_target(self) -> SnapshotTarget:
        return SnapshotTarget(self.fresh(self.work, "snap"), self.fresh(self.shm, "snap"))


async def cold_boots(b: Bench, images: dict[str, Path]) -> tuple[dict[str, list[float]], Snapshot]:
    samples: dict[str, list[float]] = {"boot": [], "snap_keep": [], "snap_stop": [], "pss": []}
    snap: Snapshot | None = None
    for run in range(RUNS):
        workdir = b.fresh(b.work, "boot")
        upper = await layers.new_upper(workdir / "upper.img", 1024)
        net = b.nets.create()
        spec = VMSpec(
            vcpus=1, memory_mib=MEMORY_MIB, kernel=images["kernel"], initrd=images["initrd"],
            cmdline=kernel_cmdline(GUEST_NET), workdir=workdir, net=net, memory_dir=b.shm,
            disks=(Disk("root", images["rootfs"], read_only=True), Disk("upper", upper),
                   Disk("envd", images["bundle"], read_only=True)),
        )  # fmt: skip
        start = time.perf_counter()
        vm = await b.driver.boot(spec)
        try:
            await wait_ready(net.netns)
            samples["boot"].append(time.perf_counter() - start)
            await agent(net.netns, "POST", "/?memory=bench&note=bench")
            await asyncio.sleep(1)
            samples["pss"].append((await vm.stats()).pss_bytes)
            keep = functools.partial(vm.snapshot, b.snapshot_target(), keep_running=True)
            t, _ = await timed(keep)
            samples["snap_keep"].append(t)
            stop = functools.partial(vm.snapshot, b.snapshot_target(), keep_running=False)
            t, snap = await timed(stop)
            samples["snap_stop"].append(t)
        finally:
            await vm.stop()
        log(f"cold boot {run + 1}/{RUNS}: {samples['boot'][-1]:.2f}s")
    assert snap is not None
    return samples, snap


async def restores(b: Bench, snap: Snapshot) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {"restore": [], "running": [], "pause": [], "resume": []}
    for _ in range(RUNS):
        target = b.target()
        assert target.net is not None
        start = time.perf_counter()
        vm = await b.driver.restore(snap, target)
        samples["running"].append(time.perf_counter() - start)
        try:
            await wait_ready(target.net.netns)
            samples["restore"].append(time.perf_counter() - start)
            for _ in range(2):
                t, _ = await timed(vm.pause)
                samples["pause"].append(t)
                t, _ = await timed(vm.resume)
                samples["resume"].append(t)
        finally:
            await vm.stop()
    log(f"restores: median {statistics.median(samples['restore']):.3f}s")
    return samples


async def clones(b: Bench, snap: Snapshot) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {"all_ready": [], "per_child": [], "pss": []}
    for run in range(RUNS):
        targets = [b.target() for _ in range(CLONES)]
        start = time.perf_counter()
        vms: list[VM] = await b.driver.restore_many(snap, targets)
        try:
            await asyncio.gather(*(wait_ready(t.net.netns) for t in targets if t.net))
            total = time.perf_counter() - start
            samples["all_ready"].append(total)
            samples["per_child"].append(total / CLONES)
            await asyncio.sleep(2)  # idle
            samples["pss"] += [(await vm.stats()).pss_bytes for vm in vms]
        finally:
            await asyncio.gather(*(vm.stop() for vm in vms))
        log(f"clones {run + 1}/{RUNS}: {CLONES} ready in {total:.2f}s")
    return samples


async def main() -> dict[str, Any]:
    async with vm_env() as env:
        driver = QemuDriver(QemuConfig(accel=env.accel), cgroups=env.cgroups)
        b = Bench(env.work, env.shm, driver, env.nets)
        boot, snap = await cold_boots(b, env.images)
        rest = await restores(b, snap)
        many = await clones(b, snap)
        accel = env.accel
    cold = statistics.median(boot["boot"])
    mib = 1 / (1 << 20)
    clone_pss = statistics.median(many["pss"])
    boot_pss = statistics.median(boot["pss"])

    def ratio(samples: list[float]) -> float:
        return round(statistics.median(samples) / cold, 5)

    return {
        "accel": accel,
        "guest_memory_mib": MEMORY_MIB,
        "runs": RUNS,
        "clones": CLONES,
        "ms": {
            "cold_boot_to_ready": summary_ms(boot["boot"]),
            "restore_to_running": summary_ms(rest["running"]),
            "restore_to_ready": summary_ms(rest["restore"]),
            "pause": summary_ms(rest["pause"]),
            "resume": summary_ms(rest["resume"]),
            "snapshot_keep_running": summary_ms(boot["snap_keep"]),
            "snapshot_template_stop": summary_ms(boot["snap_stop"]),
            "clones_all_ready": summary_ms(many["all_ready"]),
            "clones_per_child": summary_ms(many["per_child"]),
        },
        "ratio_to_cold_boot": {
            "restore_to_ready": ratio(rest["restore"]),
            "pause": ratio(rest["pause"]),
            "resume": ratio(rest["resume"]),
            "snapshot_keep_running": ratio(boot["snap_keep"]),
            "snapshot_template_stop": ratio(boot["snap_stop"]),
            "clones_all_ready": ratio(many["all_ready"]),
            "clones_per_child": ratio(many["per_child"]),
        },
        "memory_mib": {
            "pss_cold_booted_vm": summary_ms(boot["pss"], mib),
            "pss_idle_clone": summary_ms(many["pss"], mib),
            "saved_vs_independent_boots": round((boot_pss - clone_pss) * CLONES * mib, 1),
        },
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main()), indent=2))
