"""Where an idle VMM's memory goes and what the VMM settings cut (issue 16): one server per
setting, in one run, each with AENV_BENCH_VMM_N (8) sandboxes from `base` (512 MiB guests).

Each sandbox first runs a small workload twice (shell, coreutils, python when the image has it,
a file write and read: what agents do), so its translation cache holds what a used sandbox's
does rather than a fresh one's 22 MiB. Then, per setting:
- every VMM's memory split by mapping (smaps): guest RAM pages copied on write, TCG's
  translation cache, the heap, other anonymous memory (thread arenas, stacks, device buffers),
  libraries and other files; the median of each over the VMMs, private (USS) and PSS;
- latency: every sandbox runs `true` and the workload once more; p50 of each.
Settings (AENV_BENCH_VMM_SETTINGS, names from `SETTINGS`, the first the baseline; default
all): translation cache 128 (the default since 2026-12-05), 48, 64 and 32 MiB; no share slots
(`share_slots` 0: the VMM has no 9p device, which 4 are by default). Ratios are against the
baseline of the same run. (MALLOC_ARENA_MAX=2 in the VMMs' environment was measured with it too, on
2026-12-04, and saved nothing: docs/density.md.)

`.venv/bin/python bench/vmm_memory.py > vmm_memory.json` (as root, as every server bench).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from server_ns import bench_server, client_env, describe, log, run_client, vmm_processes

from aenv.config import Paths

N = int(os.environ.get("AENV_BENCH_VMM_N", "8"))
GUEST_MB = 512
SETTLE_S = 5.0
KIB = 1024
WORKLOAD = (
    "ls -la /usr/bin | wc -l",
    "cat /etc/os-release | grep -c =",
    "find /etc -name '*.conf' 2>/dev/null | head -20 | xargs -r sha256sum | wc -l",
    "command -v python3 >/dev/null && python3 -c 'import json, os; print(len(os.listdir(\"/\")))'"
    " || true",
    "for i in 1 2 3; do date +%s%N; done | sort | tail -1",
)
SETTINGS: dict[str, dict[str, str]] = {
    "tb128": {"AENV_TCG_TB_MIB": "128"},
    "slots0": {"AENV_SHARE_SLOTS": "0"},
    "tb48": {"AENV_TCG_TB_MIB": "48"},
    "tb64": {"AENV_TCG_TB_MIB": "64"},
    "tb32": {"AENV_TCG_TB_MIB": "32"},
}
CHOSEN = os.environ.get("AENV_BENCH_VMM_SETTINGS", ",".join(SETTINGS)).split(",")


def kind_of(header: list[str], memory: str) -> str:
    """The part of a VMM a mapping belongs to, from its smaps header line."""
    perms = header[1]
    path = header[5] if len(header) > 5 else ""
    if path.startswith(memory):
        return "guest_cow"
    if not path:
        return "tcg_cache" if "x" in perms and "w" in perms else "other_anon"
    if path == "[heap]":
        return "heap"
    if path.startswith("["):
        return "other_anon"
    return "files"


def vmm_parts(pid: int, memory: str) -> dict[str, dict[str, float]]:
    """One VMM's private and PSS MiB per part (guest RAM counts its anonymous pages: what the
    guest wrote; the template's pages it only reads are in the shared file)."""
    parts: dict[str, dict[str, float]] = defaultdict(lambda: {"private": 0.0, "pss": 0.0})
    kind = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5:
            kind = kind_of(head, memory)
        elif head[0] in ("Private_Clean:", "Private_Dirty:"):
            parts[kind]["private"] += int(head[1]) / KIB
        elif head[0] == "Pss:":
            parts[kind]["pss"] += int(head[1]) / KIB
    return parts


def memory_split(home: Path) -> dict[str, Any]:
    memory = str(Paths(home).memory)
    each = []
    for proc in vmm_processes(home):
        try:
            each.append(vmm_parts(proc.pid, memory))
        except OSError:
            continue
    kinds = sorted({k for parts in each for k in parts})
    split = {
        k: {
            m: round(statistics.median(p[k][m] if k in p else 0.0 for p in each), 1)
            for m in ("private", "pss")
        }
        for k in kinds
    }
    uss = [sum(p[k]["private"] for k in p) for p in each]
    pss = [sum(p[k]["pss"] for k in p) for p in each]
    return {
        "vmms": len(each),
        "parts_mib_median": split,
        "uss_mib_median": round(statistics.median(uss), 1),
        "pss_mib_median": round(statistics.median(pss), 1),
    }


def run_workload(sandbox: Any) -> float:
    start = time.perf_counter()
    for command in WORKLOAD:
        sandbox.commands.run(command, request_timeout=60)
    sandbox.files.write("/tmp/bench.txt", "x" * 4096)
    sandbox.files.read("/tmp/bench.txt")
    return time.perf_counter() - start


def timed_true(sandbox: Any) -> float:
    start = time.perf_counter()
    sandbox.commands.run("true", request_timeout=60)
    return time.perf_counter() - start


def client() -> None:
    from e2b import Sandbox

    client_env()
    home = Path(os.environ["AENV_HOME"])
    with ThreadPoolExecutor(4) as pool:
        sandboxes = list(pool.map(lambda _: Sandbox.create(timeout=3600), range(N)))
        for _ in range(2):
            list(pool.map(run_workload, sandboxes))
        time.sleep(SETTLE_S)
        split = memory_split(home)
        # One at a time: the latency of a command, not of the host's queue.
        trues = [timed_true(s) for s in sandboxes for _ in range(3)]
        workloads = [run_workload(s) for s in sandboxes]
        list(pool.map(lambda s: s.kill(), sandboxes))
    print(
        json.dumps(
            {
                **split,
                "true_p50_ms": round(statistics.median(trues) * 1000, 1),
                "workload_p50_ms": round(statistics.median(workloads) * 1000, 1),
                "load_average": os.getloadavg(),
            }
        )
    )


def main() -> None:
    results: dict[str, Any] = {}
    machine: dict[str, Any] = {}
    for i, setting in enumerate(CHOSEN):
        # A setting named again (tb48,tb64,tb48,tb64: runs interleaved against the load's
        # drift) is reported as name#2.
        name = setting if setting not in results else f"{setting}#{i}"
        env = {"AENV_SANDBOX_MEMORY_MB": str(GUEST_MB), **SETTINGS[setting]}
        with bench_server(env) as server:
            results[name] = run_client(server, [sys.executable, __file__, "--client"], 3600)
            machine = describe(server)
        log(f"{name}: {json.dumps(results[name])}")
    base = results[CHOSEN[0]]
    ratios = {
        name: {
            key: round(r[key] / base[key], 3)
            for key in ("uss_mib_median", "pss_mib_median", "true_p50_ms", "workload_p50_ms")
        }
        for name, r in results.items()
        if name != CHOSEN[0]
    }
    doc = {"benchmark": "vmm_memory", "date": time.strftime("%Y-%m-%d"), **machine, "n": N}
    print(json.dumps({**doc, "settings": results, f"vs_{CHOSEN[0]}": ratios}, indent=2))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        client()
    else:
        main()
