"""How many idle sandboxes a node holds, and what each costs the host (issue 16, item 1).

A real server (bench/server_ns.py) with 512 MiB guests; sandboxes are created from `base` in
steps up to AENV_BENCH_DENSITY_MAX (default 400) or until the host's available memory falls
to AENV_BENCH_DENSITY_FLOOR_MB (default 2048) or a create is refused. At every step, once the
new sandboxes have settled:
- host memory used: the drop of MemAvailable since before the server started its sandboxes
  (host-wide: the truth, whatever is shared or on tmpfs), per sandbox;
- PSS and USS of each VMM process (its guest RAM is a shared file mapping on /dev/shm, so
  the tmpfs size of the node's memory directory is reported beside them);
- idle host CPU per sandbox: the VMMs' CPU time over AENV_BENCH_DENSITY_WINDOW_S (10 s);
- a random 5% answer `commands.run("true")`: latency p50 and max (target: all within 5 s);
- overcommit: nominal guest RAM held / host memory used.
At the largest step, KSM is switched on for a while (its previous setting restored after) and
the pages it shares are reported: the "technique on" column for page sharing. Prints JSON.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from idle import vmm_cpu_seconds
from server_ns import (
    bench_server,
    client_env,
    describe,
    dir_size,
    log,
    run_client,
    vmm_processes,
)

from aenv.config import Paths

MAX = int(os.environ.get("AENV_BENCH_DENSITY_MAX", "400"))
STEP = int(os.environ.get("AENV_BENCH_DENSITY_STEP", "50"))
FLOOR_MB = int(os.environ.get("AENV_BENCH_DENSITY_FLOOR_MB", "2048"))
WINDOW_S = float(os.environ.get("AENV_BENCH_DENSITY_WINDOW_S", "10"))
KSM_S = float(os.environ.get("AENV_BENCH_DENSITY_KSM_S", "60"))
GUEST_MB = 512
SAMPLE = 0.05
SETTLE_S = 10.0
KSM = Path("/sys/kernel/mm/ksm")
MIB = 1 << 20


def available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def vmm_memory(home: Path) -> tuple[list[float], list[float]]:
    """PSS and USS (MiB) of every VMM of the node at `home`."""
    import psutil

    pss, uss = [], []
    for proc in vmm_processes(home):
        try:
            full = proc.memory_full_info()
        except psutil.Error:
            continue
        pss.append(full.pss / MIB)
        uss.append(full.uss / MIB)
    return pss, uss


def probe(sandboxes: list[Any]) -> dict[str, Any]:
    """`commands.run("true")` in a random 5% (at least one) of the sandboxes."""
    chosen = random.sample(sandboxes, max(1, round(len(sandboxes) * SAMPLE)))
    took = []
    for sandbox in chosen:
        start = time.perf_counter()
        sandbox.commands.run("true", request_timeout=30)
        took.append(time.perf_counter() - start)
    return {
        "sampled": len(chosen),
        "p50_ms": round(statistics.median(took) * 1000, 1),
        "max_ms": round(max(took) * 1000, 1),
        "all_within_5s": max(took) <= 5.0,
    }


def measure(sandboxes: list[Any], home: Path, baseline_mib: float) -> dict[str, Any]:
    n = len(sandboxes)
    used = baseline_mib - available_mib()
    pss, uss = vmm_memory(home)
    start = vmm_cpu_seconds(home)
    time.sleep(WINDOW_S)
    end = vmm_cpu_seconds(home)
    cores = sum(end[p] - start[p] for p in start if p in end) / WINDOW_S
    return {
        "sandboxes": n,
        "host_used_mib": round(used),
        "host_used_per_sandbox_mib": round(used / n, 1),
        "vmm_pss_mib_median": round(statistics.median(pss), 1) if pss else None,
        "vmm_uss_mib_median": round(statistics.median(uss), 1) if uss else None,
        "guest_memory_on_tmpfs_mib": round(dir_size(Paths(home).memory)["allocated_mib"]),
        "idle_cores_per_sandbox": round(cores / n, 5),
        "overcommit": round(n * GUEST_MB / used, 2) if used > 0 else None,
        "probe": probe(sandboxes),
    }


def ksm_window() -> dict[str, Any]:
    """KSM on for KSM_S seconds; what it merged. The host's setting is restored after."""
    if not (KSM / "run").exists():
        return {"available": False}
    before = (KSM / "run").read_text().strip()
    try:
        (KSM / "run").write_text("1")
        time.sleep(KSM_S)
        read = {k: int((KSM / k).read_text()) for k in ("pages_shared", "pages_sharing")}
    finally:
        (KSM / "run").write_text(before)
    return {
        "available": True,
        "seconds": KSM_S,
        **read,
        "saved_mib": read["pages_sharing"] * 4 / 1024,
    }


def client() -> None:
    from e2b import Sandbox

    client_env()
    home = Path(os.environ["AENV_HOME"])
    baseline = available_mib()
    sandboxes: list[Any] = []
    steps: list[dict[str, Any]] = []
    stopped = f"reached {MAX}"
    with ThreadPoolExecutor(4) as pool:
        while len(sandboxes) < MAX:
            if available_mib() < FLOOR_MB:
                stopped = f"host available memory below {FLOOR_MB} MiB"
                break
            want = min(STEP, MAX - len(sandboxes))
            futures = [pool.submit(Sandbox.create, timeout=3600) for _ in range(want)]
            failed = 0
            for future in futures:
                try:
                    sandboxes.append(future.result())
                except Exception as error:
                    failed += 1
                    stopped = f"a create failed: {error}"
            time.sleep(SETTLE_S)
            steps.append(measure(sandboxes, home, baseline))
            log(f"{len(sandboxes)} sandboxes: {json.dumps(steps[-1])}")
            if failed:
                break
        ksm = ksm_window() if sandboxes else {}
        if sandboxes:
            ksm["host_used_mib_after"] = round(baseline - available_mib())
        list(pool.map(lambda s: s.kill(), sandboxes))
    print(json.dumps({"steps": steps, "stopped": stopped, "ksm": ksm}))


def main() -> None:
    env = {
        "AENV_SANDBOX_MEMORY_MB": str(GUEST_MB),
        "AENV_MAX_SANDBOXES": str(MAX + 8),
        "AENV_KEY_MAX_SANDBOXES": str(MAX + 8),
    }
    with bench_server(env) as server:
        result = run_client(server, [sys.executable, __file__, "--client"], timeout=7200)
        machine = describe(server)
    print(
        json.dumps({"benchmark": "density", "date": time.strftime("%Y-%m-%d"), **machine, **result})
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        client()
    else:
        main()
