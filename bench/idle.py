"""What an idle sandbox costs the host: CPU of its VMM while nothing runs in the guest.

Density under emulation (TCG) is bound by this: every idle guest's timer interrupts and
daemons run on an emulated CPU. The bench starts a real server (bench/server_ns.py), creates
AENV_BENCH_IDLE_N sandboxes (default 8) from `base`, lets them settle, and samples their VMMs'
CPU time over AENV_BENCH_IDLE_S seconds (default 10). Baseline in the same run: one sandbox
spinning a shell loop (`while :; do :; done`), i.e. what one busy guest costs; the ratio says
how many idle sandboxes cost as much as one busy one. Techniques off in the same run, N more
idle sandboxes each:
- our init's sysctls back at the kernel's defaults: `vm.compaction_proactiveness` 20 (our init
  sets 0), the neighbour tables' `interval_probe_time_ms` 5000 (3600000) and
  `vm.stat_interval` 1 (10); `psi=0` on the kernel command line cannot be undone at run time;
- host-side metrics: the server reads an idle sandbox's CPU from its VMM and asks its envd for
  `/metrics` once a minute (`orchestrator/metrics_history.py`); these get what every sandbox got
  before, an envd `GET /metrics` every `INTERVAL` seconds (sent here by the client).
Also the guest's timer interrupts a second (`LOC` of /proc/interrupts over 10 s, in an idle
sandbox after the window). Prints JSON.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from server_ns import (
    bench_server,
    client_env,
    describe,
    entry,
    log,
    report,
    run_client,
    vmm_processes,
)

from aenv.orchestrator.metrics_history import INTERVAL

N = int(os.environ.get("AENV_BENCH_IDLE_N", "8"))
WINDOW_S = float(os.environ.get("AENV_BENCH_IDLE_S", "10"))
SETTLE_S = 5.0
KERNEL_DEFAULTS = (
    "echo 20 > /proc/sys/vm/compaction_proactiveness; echo 1 > /proc/sys/vm/stat_interval; "
    "for t in ipv4 ipv6; do echo 5000 > /proc/sys/net/$t/neigh/default/interval_probe_time_ms; done"
)
LOC_S = 10
TIMER_IRQS = f"grep LOC /proc/interrupts; sleep {LOC_S}; grep LOC /proc/interrupts"


def vmm_cpu_seconds(home: Path) -> dict[int, float]:
    """CPU seconds (user + system) of every QEMU process of this node, by pid."""
    import psutil

    found: dict[int, float] = {}
    for proc in vmm_processes(home):
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        found[proc.pid] = times.user + times.system
    return found


def ask_metrics(sandboxes: list[Any], done: threading.Event) -> None:
    """What the metrics sampler did before it read CPU on the host: an envd `GET /metrics` to
    each sandbox every `INTERVAL` seconds."""
    while not done.wait(INTERVAL):
        for sbx in sandboxes:
            sbx._envd_api.get("/metrics").raise_for_status()


def timer_irqs_per_s(output: str) -> float:
    """Local timer interrupts a second from two `LOC` lines of /proc/interrupts `LOC_S` apart
    (summed over the guest's CPUs)."""
    first, second = (
        [int(v) for v in line.split()[1:] if v.isdigit()] for line in output.strip().splitlines()
    )
    return round((sum(second) - sum(first)) / LOC_S, 1)


def client() -> None:
    from e2b import Sandbox

    client_env()
    home = Path(os.environ["AENV_HOME"])
    before_busy = set(vmm_cpu_seconds(home))
    busy = Sandbox.create(timeout=600)
    busy.commands.run("while :; do :; done", background=True)
    busy_pids = set(vmm_cpu_seconds(home)) - before_busy
    before_idle = set(vmm_cpu_seconds(home))
    idle = [Sandbox.create(timeout=600) for _ in range(N)]
    idle_pids = set(vmm_cpu_seconds(home)) - before_idle
    defaults = [Sandbox.create(timeout=600) for _ in range(N)]
    for sbx in defaults:
        sbx.commands.run(KERNEL_DEFAULTS, user="root")
    defaults_pids = set(vmm_cpu_seconds(home)) - busy_pids - idle_pids
    asked = [Sandbox.create(timeout=600) for _ in range(N)]
    done = threading.Event()
    asking = threading.Thread(target=ask_metrics, args=(asked, done), daemon=True)
    asking.start()
    log(f"{3 * N} idle sandboxes and one busy one; settling {SETTLE_S:.0f} s")
    time.sleep(SETTLE_S)
    start = vmm_cpu_seconds(home)
    time.sleep(WINDOW_S)
    end = vmm_cpu_seconds(home)
    done.set()
    asking.join()
    irqs = timer_irqs_per_s(idle[0].commands.run(TIMER_IRQS).stdout)
    for sbx in [busy, *idle, *defaults, *asked]:
        sbx.kill()
    used = {pid: (end[pid] - start[pid]) / WINDOW_S for pid in start if pid in end}
    idle_cores = [c for pid, c in used.items() if pid in idle_pids]
    defaults_cores = [c for pid, c in used.items() if pid in defaults_pids]
    asked_cores = [c for pid, c in used.items() if pid not in idle_pids | defaults_pids | busy_pids]
    busy_cores = [c for pid, c in used.items() if pid in busy_pids]
    per_idle = sum(idle_cores) / len(idle_cores)
    per_defaults = sum(defaults_cores) / len(defaults_cores)
    per_asked = sum(asked_cores) / len(asked_cores)
    result: dict[str, Any] = {
        "idle_sandboxes": len(idle_cores),
        "window_s": WINDOW_S,
        "idle_cores_per_sandbox": round(per_idle, 4),
        "idle_cores_each": [round(c, 4) for c in sorted(idle_cores)],
        "busy_cores": round(sum(busy_cores), 3),
        "ratio_idle_to_busy": round(per_idle / max(sum(busy_cores), 1e-9), 4),
        "idle_sandboxes_per_core": round(1 / per_idle) if per_idle else None,
        "kernel_default_sysctls_cores_per_sandbox": round(per_defaults, 4),
        "ratio_our_sysctls_to_kernel_defaults": round(per_idle / max(per_defaults, 1e-9), 3),
        "envd_metrics_every_interval_cores_per_sandbox": round(per_asked, 4),
        "ratio_host_metrics_to_envd_every_interval": round(per_idle / max(per_asked, 1e-9), 3),
        "guest_timer_irqs_per_s": irqs,
    }
    print(json.dumps(result))


def main() -> None:
    with bench_server() as server:
        result = run_client(server, [sys.executable, __file__, "--client"], timeout=1800)
        machine = describe(server)
    report("idle", **machine, **result)


if __name__ == "__main__":
    entry(main, client)
