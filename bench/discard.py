"""What passing discards through costs: the same operations with QEMU's writable drives given
`discard=unmap,detect-zeroes=unmap` (the default) and without (`QemuConfig(discard=False)`), in one
run, alternating which goes first.

Each run restores the template (to the VMM running, and to the guest agent answering the first
command: a create), then in the guest writes `WRITE_MIB` of non-zero data and syncs, deletes it
and syncs (the guest mounts its layer with `discard`, so the delete sends discards), and writes
`WRITE_MIB` of zeros and syncs. Recorded: each step's time, and the writable top's allocated size
on the host after the delete (what the guest's deleted file still costs the host). Ratios are
discard / no-discard medians. The jail and template come from bench/jail.py. Prints one JSON
document on stdout; progress goes to stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jail import Places, log, run_in_guest, template  # noqa: E402
from summary import summary_ms  # noqa: E402
from vm_env import vm_env  # noqa: E402

from aenv.runtime.driver import VM, Snapshot  # noqa: E402
from aenv.runtime.qemu import QemuConfig, QemuDriver, QemuVM  # noqa: E402
from aenv.storage import layers  # noqa: E402
from tests.runtime.qemu_vm.netns import wait_ready  # noqa: E402

RUNS = int(os.environ.get("AENV_BENCH_RUNS", "6"))
WRITE_MIB = 64
MODES = ("discard", "no_discard")
TIMES = ("running", "first_command", "write", "delete", "write_zeros")


async def guest(netns: str, script: str) -> None:
    await run_in_guest(netns, ["sh", "-c", script], timeout_s=300)


def allocated_mib(vm: VM) -> float:
    assert isinstance(vm, QemuVM)
    (top,) = [d.path for d in vm.spec.disks if d.drive_id == "upper"]
    return layers.allocated_bytes(top) / (1 << 20)


async def one_run(driver: QemuDriver, p: Places, snap: Snapshot) -> dict[str, float]:
    target = p.target()
    assert target.net is not None
    netns = target.net.netns
    start = time.perf_counter()
    vm = await driver.restore(snap, target)
    out = {"running": time.perf_counter() - start}
    try:
        await wait_ready(netns)
        await guest(netns, "true")
        out["first_command"] = time.perf_counter() - start
        steps = {
            "write": f"head -c {WRITE_MIB}M /dev/zero | tr '\\000' Z > /home/user/big && sync",
            "delete": "rm /home/user/big && sync",
            "write_zeros": f"head -c {WRITE_MIB}M /dev/zero > /home/user/big && sync",
        }
        for step, script in steps.items():
            began = time.perf_counter()
            await guest(netns, script)
            out[step] = time.perf_counter() - began
            if step == "delete":
                out["allocated_after_delete_mib"] = allocated_mib(vm)
    finally:
        await vm.stop()
    return out


async def main() -> dict[str, Any]:
    samples: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    async with vm_env() as env:
        accel = env.accel
        drivers = {
            "discard": QemuDriver(QemuConfig(accel=accel), cgroups=env.cgroups),
            "no_discard": QemuDriver(QemuConfig(accel=accel, discard=False), cgroups=env.cgroups),
        }
        p = Places(env.work, env.shm, env.nets)
        snap = await template(drivers["discard"], p, env.images)
        for run in range(RUNS):
            for mode in MODES if run % 2 == 0 else MODES[::-1]:
                for key, value in (await one_run(drivers[mode], p, snap)).items():
                    samples[mode].setdefault(key, []).append(value)
            log(f"run {run + 1}/{RUNS}")

    def ratio(key: str) -> float:
        with_, without = (statistics.median(samples[m][key]) for m in MODES)
        return round(with_ / without, 3)

    return {
        "accel": accel,
        "write_mib": WRITE_MIB,
        "runs": RUNS,
        "ms": {m: {k: summary_ms(samples[m][k]) for k in TIMES} for m in MODES},
        "allocated_after_delete_mib": {
            m: round(statistics.median(samples[m]["allocated_after_delete_mib"]), 1) for m in MODES
        },
        "ratio_discard_to_no_discard": {k: ratio(k) for k in TIMES},
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main()), indent=2))
