"""Idle hibernation (issue 16): what a hibernated sandbox costs the node and what waking it
costs its next request. One server with `AENV_HIBERNATE_AFTER` = AENV_BENCH_HIBERNATE_AFTER
(5 s), AENV_BENCH_HIBERNATE_N (20) sandboxes from `base` (512 MiB guests), each running one
command, then left idle:
- awake (right after the creates): the VMMs' USS summed, the host's available memory used;
- hibernated (once every sandbox is, per the catalog): VMMs left, the host memory used, and what
  each sandbox holds on disk (its checkpoint and disk layer) and on tmpfs;
- a wake: `commands.run("true")` on each hibernated sandbox (restore + `/init` + the command),
  against a second `true` right after in the same, awake sandbox; p50 of each (one sandbox
  at a time, the second before the sandbox can hibernate again).
Memory figures are host-wide (MemAvailable) and so move with other work on the host; the VMM
count and the disk are the node's own. Prints one JSON document.

`.venv/bin/python bench/hibernation.py > hibernation.json` (as root).
"""

from __future__ import annotations

import json
import os
import sqlite3
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from server_ns import bench_server, client_env, describe, dir_size, log, run_client, wait_until

from aenv.config import Paths

N = int(os.environ.get("AENV_BENCH_HIBERNATE_N", "20"))
AFTER = int(os.environ.get("AENV_BENCH_HIBERNATE_AFTER", "5"))
GUEST_MB = 512
MIB = 1 << 20


def available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def states(home: Path) -> dict[str, str]:
    db = sqlite3.connect(f"file:{Paths(home).catalog}?mode=ro", uri=True, timeout=10)
    try:
        return dict(db.execute("SELECT id, state FROM sandboxes").fetchall())
    finally:
        db.close()


def vmms(home: Path) -> tuple[int, float]:
    """The node's VMMs: how many, and their USS summed (MiB)."""
    from server_ns import vmm_processes

    count, uss = 0, 0.0
    for proc in vmm_processes(home):
        try:
            uss += proc.memory_full_info().uss / MIB
            count += 1
        except Exception:  # gone meanwhile
            continue
    return count, round(uss, 1)


def timed(run: Any) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def client() -> None:
    from e2b import Sandbox

    client_env()
    home = Path(os.environ["AENV_HOME"])
    paths = Paths(home)
    baseline = available_mib()
    with ThreadPoolExecutor(4) as pool:
        sandboxes = list(pool.map(lambda _: Sandbox.create(timeout=3600), range(N)))
        list(pool.map(lambda s: s.commands.run("true"), sandboxes))
        awake_vmms, awake_uss = vmms(home)
        awake_used = baseline - available_mib()
        ids = {s.sandbox_id for s in sandboxes}
        slept = wait_until(
            lambda: all(states(home).get(i) == "hibernated" for i in ids), 60 + 4 * AFTER * N
        )
        time.sleep(2)  # the last VMMs' exit
        asleep_vmms, asleep_uss = vmms(home)
        asleep_used = baseline - available_mib()
        disk = dir_size(paths.sandboxes)
        tmpfs = dir_size(paths.memory / "sandboxes")
        # One at a time: the latency a request sees, not the host's queue.
        wakes, seconds = [], []
        for sandbox in sandboxes:
            wakes.append(timed(lambda s=sandbox: s.commands.run("true")))
            seconds.append(timed(lambda s=sandbox: s.commands.run("true")))
        list(pool.map(lambda s: s.kill(), sandboxes))
    print(
        json.dumps(
            {
                "sandboxes": N,
                "hibernate_after_s": AFTER,
                "awake": {"vmms": awake_vmms, "vmm_uss_sum_mib": awake_uss},
                "awake_host_used_mib": round(awake_used),
                "all_hibernated_after_s": round(slept, 1),
                "hibernated": {"vmms": asleep_vmms, "vmm_uss_sum_mib": asleep_uss},
                "hibernated_host_used_mib": round(asleep_used),
                "disk_per_sandbox_mib": round(disk["allocated_mib"] / N, 1),
                "tmpfs_per_sandbox_mib": round(tmpfs["allocated_mib"] / N, 1),
                "wake_true_p50_ms": round(statistics.median(wakes) * 1000, 1),
                "wake_true_max_ms": round(max(wakes) * 1000, 1),
                "awake_true_p50_ms": round(statistics.median(seconds) * 1000, 1),
                "load_average": os.getloadavg(),
            }
        )
    )


def main() -> None:
    env = {
        "AENV_SANDBOX_MEMORY_MB": str(GUEST_MB),
        "AENV_HIBERNATE_AFTER": str(AFTER),
        # Hibernated sandboxes count as held: the node and the key must admit all N.
        "AENV_MAX_SANDBOXES": str(N + 8),
        "AENV_KEY_MAX_SANDBOXES": str(N + 8),
    }
    with bench_server(env) as server:
        result = run_client(server, [sys.executable, __file__, "--client"], 3600)
        machine = describe(server)
    log(json.dumps(result))
    doc = {"benchmark": "hibernation", "date": time.strftime("%Y-%m-%d"), **machine}
    print(json.dumps({**doc, **result}, indent=2))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        client()
    else:
        main()
