"""What the checksums of saved states cost (runtime/checksums.py), with the QEMU driver (TCG
here, KVM with AENV_BENCH_ACCEL=kvm) on a guest of AENV_BENCH_GUEST_MIB (512) MiB.

AENV_BENCH_RUNS (5) times, a VM is booted and saved (as a template is, or a pause of a sandbox
booted from its disks: its whole memory file is new); then, as often, a clone restored from the
last of them writes to its memory and disk and is saved as a pause (`VM.snapshot`, VM stops),
and again a clone as a snapshot that keeps running. For each save:
- the save's time, and its `manifest` step (the driver's step log): writing `snapshot.json`,
  which now hashes every file the node has not hashed yet. The baseline, measured in the same
  run, is the same save without that step's hashing: its time less the step (the manifest
  itself, a small JSON file, took about 1 ms before checksums);
- what a resume adds: `load_saved` of the pause at once (files known to this process), and in
  a fresh process, as after a node restart (every file read and hashed).
Prints one JSON document on stdout; progress goes to stderr.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from summary import summary_ms  # noqa: E402
from vm_env import vm_env  # noqa: E402

from aenv.guest.cmdline import kernel_cmdline  # noqa: E402
from aenv.runtime.driver import Disk, RestoreSpec, Snapshot, SnapshotTarget, VMSpec  # noqa: E402
from aenv.runtime.qemu import QemuConfig, QemuDriver  # noqa: E402
from aenv.storage import layers  # noqa: E402
from tests.runtime.qemu_vm.netns import GUEST_NET, NetnsPool, agent, wait_ready  # noqa: E402

RUNS = int(os.environ.get("AENV_BENCH_RUNS", "5"))
MEMORY_MIB = int(os.environ.get("AENV_BENCH_GUEST_MIB", "512"))
# A fresh process's `load_saved`: hashes every file, as the first resume after a restart does.
COLD_LOAD = (
    "import sys, time; from pathlib import Path; from aenv.runtime import export; "
    "t = time.perf_counter(); export.load(Path(sys.argv[1]), 'qemu'); "
    "print(time.perf_counter() - t)"
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class StepLog(logging.Handler):
    """The `manifest` step of each save the driver logs."""

    def __init__(self) -> None:
        super().__init__()
        self.manifest_ms: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = re.search(r"manifest (\d+)", record.getMessage())
        if record.getMessage().startswith("snapshot of VM") and found:
            self.manifest_ms.append(float(found.group(1)))


class Places:
    def __init__(self, work: Path, shm: Path, nets: NetnsPool) -> None:
        self.work, self.shm, self.nets = work, shm, nets
        self.count = 0

    def fresh(self, root: Path, prefix: str) -> Path:
        self.count += 1
        path = root / f"{prefix}{self.count}"
        path.mkdir()
        return path

    def target(self) -> RestoreSpec:
        return RestoreSpec(self.fresh(self.work, "vm"), self.nets.create(), self.shm)

    def snapshot_target(self) -> SnapshotTarget:
        return SnapshotTarget(self.fresh(self.work, "snap"), self.fresh(self.shm, "snap"))


async def booted_save(
    driver: QemuDriver, places: Places, images: dict[str, Path], steps: StepLog
) -> tuple[float, float, Snapshot]:
    """A cold-booted VM's save (a template's, or a pause of a sandbox booted from its disks):
    its memory file is handed over whole, so the manifest hashes all of it. Its time and its
    manifest step, in seconds."""
    workdir = places.fresh(places.work, "boot")
    upper = await layers.new_upper(workdir / "upper.img", 1024)
    net = places.nets.create()
    spec = VMSpec(
        vcpus=1, memory_mib=MEMORY_MIB, kernel=images["kernel"], initrd=images["initrd"],
        cmdline=kernel_cmdline(GUEST_NET), workdir=workdir, net=net, memory_dir=places.shm,
        disks=(Disk("root", images["rootfs"], read_only=True), Disk("upper", upper),
               Disk("envd", images["bundle"], read_only=True)),
    )  # fmt: skip
    vm = await driver.boot(spec)
    try:
        await wait_ready(net.netns)
        start = time.perf_counter()
        snap = await vm.snapshot(places.snapshot_target(), keep_running=False)
        took = time.perf_counter() - start
    finally:
        await vm.stop()
    return took, steps.manifest_ms[-1] / 1000, snap


async def save(
    driver: QemuDriver, places: Places, base: Snapshot, steps: StepLog, keep_running: bool
) -> tuple[float, float, Snapshot]:
    """A clone's save after it wrote; its time and its manifest step, in seconds."""
    target = places.target()
    assert target.net is not None
    vm = await driver.restore(base, target)
    try:
        await wait_ready(target.net.netns)
        await agent(target.net.netns, "POST", "/?memory=bench&note=bench")
        start = time.perf_counter()
        snap = await vm.snapshot(places.snapshot_target(), keep_running=keep_running)
        took = time.perf_counter() - start
    finally:
        await vm.stop()
    return took, steps.manifest_ms[-1] / 1000, snap


def cold_load(directory: Path) -> float:
    out = subprocess.run(
        [sys.executable, "-c", COLD_LOAD, str(directory)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )
    return float(out.stdout)


def figures(saves: list[float], manifests: list[float]) -> dict[str, Any]:
    before = [s - m for s, m in zip(saves, manifests, strict=True)]
    return {
        "save_ms": summary_ms(saves),
        "manifest_step_ms": summary_ms(manifests),
        "baseline_without_checksums_ms": summary_ms(before),
        "ratio_after_to_before": round(statistics.median(saves) / statistics.median(before), 4),
    }


async def main() -> dict[str, Any]:
    steps = StepLog()
    logging.getLogger("aenv.runtime").addHandler(steps)
    logging.getLogger("aenv.runtime").setLevel(logging.INFO)
    kinds = ("booted", "pause", "keep")
    samples: dict[str, list[float]] = {
        name: [] for name in (*kinds, *(f"{k}_manifest" for k in kinds), "warm", "cold")
    }
    async with vm_env() as env:
        driver = QemuDriver(QemuConfig(accel=env.accel), cgroups=env.cgroups)
        places = Places(env.work, env.shm, env.nets)
        for run in range(RUNS):
            took, manifest, base = await booted_save(driver, places, env.images, steps)
            samples["booted"].append(took)
            samples["booted_manifest"].append(manifest)
            log(f"boot {run + 1}/{RUNS}: save {took:.2f}s")
        for run in range(RUNS):
            took, manifest, paused = await save(driver, places, base, steps, False)
            samples["pause"].append(took)
            samples["pause_manifest"].append(manifest)
            directory = paused.state_file.parent
            start = time.perf_counter()
            await driver.load_saved(directory)
            samples["warm"].append(time.perf_counter() - start)
            samples["cold"].append(await asyncio.to_thread(cold_load, directory))
            took, manifest, _ = await save(driver, places, base, steps, True)
            samples["keep"].append(took)
            samples["keep_manifest"].append(manifest)
            log(f"run {run + 1}/{RUNS}: pause {samples['pause'][-1]:.2f}s")
        accel = env.accel
    return {
        "accel": accel,
        "guest_memory_mib": MEMORY_MIB,
        "runs": RUNS,
        "save_of_a_booted_vm": figures(samples["booted"], samples["booted_manifest"]),
        "pause": figures(samples["pause"], samples["pause_manifest"]),
        "snapshot_keep_running": figures(samples["keep"], samples["keep_manifest"]),
        "resume_load_saved_ms": {
            "same_process": summary_ms(samples["warm"]),
            "after_a_restart": summary_ms(samples["cold"]),
        },
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main()), indent=2))
