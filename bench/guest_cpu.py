"""What the emulated CPU costs under TCG: the same guest work on today's VMM settings and on
variants of them, in one run, alternating their order: the CPU model before (`LEGACY_TCG_CPU`,
`max` with 5-level paging) and smaller translation caches (48 MiB, the default before; 64).

Each CPU model boots its own template (a template is restored on the model it was taken on).
Each run restores it, makes it a used sandbox (one unmeasured pass of the steps), then times a
second pass of steps that stand for what sandboxes do: starting processes (`bash -l -c true`,
as every SDK command does), system calls (opening and closing a file), pure Python, and Python
starts with their imports. Recorded per step: the wall time and the host CPU the VMM spent
(what the emulation costs; less sensitive than the wall time to other load on the host).
Ratios are variant / today's medians: above 1, the variant costs more. Prints one JSON document
on stdout; progress goes to stderr.
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

from jail import Places, log, run_in_guest, template, vmm_cpu  # noqa: E402
from vm_env import vm_env  # noqa: E402

from aenv.runtime.driver import Snapshot  # noqa: E402
from aenv.runtime.qemu import (  # noqa: E402
    LEGACY_TCG_CPU,
    TCG_CPU,
    TCG_TB_MIB,
    QemuConfig,
    QemuDriver,
    QemuVM,
)
from tests.runtime.qemu_vm.netns import wait_ready  # noqa: E402

RUNS = int(os.environ.get("AENV_BENCH_RUNS", "3"))
IMPORTS = "import asyncio, json, http.server, email.parser, ssl, sqlite3, decimal, unittest"
STEPS = {
    "spawn_20": ["sh", "-c", "for i in $(seq 20); do bash -l -c true; done"],
    "syscalls_3k": ["python3", "-c", "for _ in range(3000): open('/proc/self/stat').close()"],
    "python_300k": ["python3", "-c", "x = 0\nfor i in range(300_000): x += i"],
    "imports_3": ["sh", "-c", f"for i in 1 2 3; do python3 -c '{IMPORTS}'; done"],
}


async def one_run(driver: QemuDriver, p: Places, snap: Snapshot) -> dict[str, float]:
    target = p.target()
    assert target.net is not None
    netns = target.net.netns
    vm = await driver.restore(snap, target)
    assert isinstance(vm, QemuVM)
    out = {}
    try:
        await wait_ready(netns)
        for argv in STEPS.values():  # a used sandbox: its caches hold what it ran
            await run_in_guest(netns, argv, timeout_s=600)
        total = vmm_cpu(vm)
        for step, argv in STEPS.items():
            cpu, began = vmm_cpu(vm), time.perf_counter()
            await run_in_guest(netns, argv, timeout_s=600)
            out[f"{step}_ms"] = (time.perf_counter() - began) * 1000
            out[f"{step}_cpu_ms"] = (vmm_cpu(vm) - cpu) * 1000
        out["all_steps_cpu_ms"] = (vmm_cpu(vm) - total) * 1000
    finally:
        await vm.stop()
    return out


async def main() -> dict[str, Any]:
    async with vm_env() as env:
        if env.accel != "tcg":
            raise SystemExit("what is compared here is TCG's (AENV_BENCH_ACCEL=tcg)")

        def driver(tb_mib: int = TCG_TB_MIB, older_cpu: bool = False) -> QemuDriver:
            made = QemuDriver(QemuConfig(accel="tcg", tb_size_mib=tb_mib), cgroups=env.cgroups)
            if older_cpu:
                made._platforms = made._platforms[1:]  # boots what drivers before TCG_CPU did
            return made

        drivers = {
            "today": driver(),
            "older_cpu": driver(older_cpu=True),
            "tb_48": driver(tb_mib=48),
            "tb_64": driver(tb_mib=64),
        }
        p = Places(env.work, env.shm, env.nets)
        today = await template(drivers["today"], p, env.images)
        older = await template(drivers["older_cpu"], p, env.images)
        snaps = {name: older if name == "older_cpu" else today for name in drivers}
        samples: dict[str, dict[str, list[float]]] = {name: {} for name in drivers}
        order = list(drivers)
        for run in range(RUNS):
            for name in order if run % 2 == 0 else order[::-1]:
                for key, value in (await one_run(drivers[name], p, snaps[name])).items():
                    samples[name].setdefault(key, []).append(value)
            log(f"run {run + 1}/{RUNS}")

    medians = {
        n: {k: round(statistics.median(v)) for k, v in s.items()} for n, s in samples.items()
    }
    base = medians["today"]
    return {
        "today": {"cpu_model": TCG_CPU, "tb_mib": TCG_TB_MIB},
        "variants": {"older_cpu": LEGACY_TCG_CPU, "tb_48": "48 MiB", "tb_64": "64 MiB"},
        "runs": RUNS,
        "median_ms": medians,
        "ratio_to_today": {
            n: {k: round(m[k] / base[k], 3) for k in base}
            for n, m in medians.items()
            if n != "today"
        },
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main()), indent=2))
