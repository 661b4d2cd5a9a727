"""How many idle sandboxes a node holds, what each costs the host, and what each density technique
changes, each on and off in one run (issue 16). Prints JSON and draws docs/density.png.

Phase "default": a real server (bench/server_ns.py) with 512 MiB guests; sandboxes are created
from `base` in steps of AENV_BENCH_DENSITY_STEP up to AENV_BENCH_DENSITY_MAX (default 400), or
until the host's available memory falls to AENV_BENCH_DENSITY_FLOOR_MB or a create fails. At
every step, once the new sandboxes settled:
- host memory used: the drop of MemAvailable since before the first create (host-wide: the
  truth whatever is shared or on tmpfs; other work on the host shows in it too), per sandbox;
- PSS and USS of each VMM process, and the tmpfs the node's memory directory takes;
- idle host CPU per sandbox: the VMMs' CPU time over AENV_BENCH_DENSITY_WINDOW_S (10 s);
- a random 5% answer `commands.run("true")`: p50 and max (target: all within 5 s);
- overcommit: nominal guest RAM held / host memory used.
At the largest step, techniques are switched on one after the other and measured against the
step just taken (technique off):
- where idle CPU goes: VMM CPU in QEMU's main loop and in its other threads (vCPU, workers);
- page-cache trim: every guest drops its page cache (`echo 3 > drop_caches`, as envd's idle
  trim would); host memory after;
- KSM for AENV_BENCH_DENSITY_KSM_S (60 s; the host's setting restored after): pages merged and
  host memory after.
Phase "small_tb": a second server whose VMMs have a AENV_BENCH_DENSITY_TB_MIB MiB TCG
translation cache instead of the node's default (`TCG_TB_MIB`) (default 16: with 8, envd's
start in the template build thrashes the cache), with AENV_BENCH_DENSITY_TB_N (10) sandboxes;
compared with the default phase's step of the same size: VMM USS and `commands.run("true")`
latency.

The 400-sandbox run (quiet machine): `sudo .venv/bin/python bench/density.py` (defaults);
a moderate one: `AENV_BENCH_DENSITY_MAX=40 AENV_BENCH_DENSITY_STEP=10 ...`; `--plot run.json`
redraws the plot from a run's output.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from idle import vmm_cpu_seconds
from server_ns import (
    REPO,
    bench_server,
    client_env,
    describe,
    dir_size,
    log,
    run_client,
    vmm_processes,
)

from aenv.config import Paths
from aenv.runtime.ksm import Ksm, KsmSettings, merged_pages
from aenv.runtime.qemu import TCG_TB_MIB

MAX = int(os.environ.get("AENV_BENCH_DENSITY_MAX", "400"))
STEP = int(os.environ.get("AENV_BENCH_DENSITY_STEP", "50"))
FLOOR_MB = int(os.environ.get("AENV_BENCH_DENSITY_FLOOR_MB", "2048"))
WINDOW_S = float(os.environ.get("AENV_BENCH_DENSITY_WINDOW_S", "10"))
KSM_S = float(os.environ.get("AENV_BENCH_DENSITY_KSM_S", "60"))
TB_MIB = int(os.environ.get("AENV_BENCH_DENSITY_TB_MIB", "16"))
TB_N = int(os.environ.get("AENV_BENCH_DENSITY_TB_N", "10"))
PLOT = Path(os.environ.get("AENV_BENCH_DENSITY_PLOT", str(REPO / "docs" / "density.png")))
GUEST_MB = 512
SAMPLE = 0.05
SETTLE_S = 10.0
MIB = 1 << 20
TRIM = "sync; echo 3 > /proc/sys/vm/drop_caches"
TRIM_COST_MIB = 40


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


def probe(sandboxes: list[Any], share: float = SAMPLE) -> dict[str, Any]:
    """`commands.run("true")` in a random `share` (at least one) of the sandboxes."""
    chosen = random.sample(sandboxes, max(1, round(len(sandboxes) * share)))
    took, failed = [], []
    for sandbox in chosen:
        start = time.perf_counter()
        try:
            sandbox.commands.run("true", request_timeout=30)
        except Exception as error:  # a saturated host: the figure to report, not a crash
            failed.append(f"{type(error).__name__}: {str(error)[:120]}")
            continue
        took.append(time.perf_counter() - start)
    return {
        "sampled": len(chosen),
        "failed": failed,
        "p50_ms": round(statistics.median(took) * 1000, 1) if took else None,
        "max_ms": round(max(took) * 1000, 1) if took else None,
        "all_within_5s": not failed and max(took) <= 5.0,
    }


def used_mib(baseline_mib: float) -> float:
    return baseline_mib - available_mib()


def idle_cores(home: Path) -> float:
    start = vmm_cpu_seconds(home)
    time.sleep(WINDOW_S)
    end = vmm_cpu_seconds(home)
    return sum(end[p] - start[p] for p in start if p in end) / WINDOW_S


def measure(sandboxes: list[Any], home: Path, baseline_mib: float) -> dict[str, Any]:
    n = len(sandboxes)
    used = used_mib(baseline_mib)
    pss, uss = vmm_memory(home)
    cores = idle_cores(home)
    return {
        "sandboxes": n,
        "host_used_mib": round(used),
        "host_used_per_sandbox_mib": round(used / n, 1),
        "vmm_pss_mib_median": round(statistics.median(pss), 1) if pss else None,
        "vmm_uss_mib_median": round(statistics.median(uss), 1) if uss else None,
        "vmm_uss_sum_mib": round(sum(uss), 1),
        "guest_memory_on_tmpfs_mib": round(dir_size(Paths(home).memory)["allocated_mib"]),
        "vmm_parts_mib": vmm_parts_mib(home),
        "idle_cores": round(cores, 4),
        "idle_cores_per_sandbox": round(cores / n, 5),
        "overcommit": round(n * GUEST_MB / used, 2) if used > 0 else None,
        "probe": probe(sandboxes),
    }


def thread_cpu(home: Path) -> dict[str, float]:
    """Cores the node's VMMs spend over WINDOW_S in QEMU's main loop (the thread whose id is the
    process's) and in its other threads (the vCPU emulating the guest, idle workers), summed
    over VMMs. (QEMU 7.2 names its threads only with `-name ...,debug-threads=on`, which our
    VMM sweep's reading of `-name` does not expect.)"""

    def sample() -> dict[tuple[int, int], float]:
        found = {}
        tick = os.sysconf("SC_CLK_TCK")
        for proc in vmm_processes(home):
            for task in Path(f"/proc/{proc.pid}/task").glob("*"):
                try:
                    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                found[(proc.pid, int(task.name))] = (int(fields[11]) + int(fields[12])) / tick
        return found

    start = sample()
    time.sleep(WINDOW_S)
    end = sample()
    by_kind: dict[str, float] = defaultdict(float)
    for (pid, tid), seconds in end.items():
        if (pid, tid) in start:
            kind = "main_loop" if tid == pid else "vcpu_and_workers"
            by_kind[kind] += (seconds - start[(pid, tid)]) / WINDOW_S
    return {kind: round(cores, 4) for kind, cores in sorted(by_kind.items())}


def vmm_parts_mib(home: Path) -> dict[str, float]:
    """Summed over the node's VMMs, from their smaps: the guest pages they copied on write
    (anonymous pages of the guest RAM mapping, a file under the memory tree), and TCG's
    translation cache (the one anonymous executable mapping)."""
    memory = str(Paths(home).memory)
    guest = tcg = 0
    for proc in vmm_processes(home):
        try:
            lines = Path(f"/proc/{proc.pid}/smaps").read_text().splitlines()
        except OSError:
            continue
        kind = ""
        for line in lines:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's header line
                path = head[5] if len(head) > 5 else ""
                kind = "guest" if path.startswith(memory) else ""
                kind = "tcg" if not path and "x" in head[1] and "w" in head[1] else kind
            elif head[0] == "Anonymous:" and kind:
                guest += int(head[1]) if kind == "guest" else 0
                tcg += int(head[1]) if kind == "tcg" else 0
    return {"guest_cow_mib": round(guest / 1024, 1), "tcg_cache_mib": round(tcg / 1024, 1)}


def uss_sum_mib(home: Path) -> float:
    """What the node's VMMs hold alone (USS), summed: unlike MemAvailable, blind to the rest of
    a shared host."""
    return round(sum(vmm_memory(home)[1]), 1)


def trim(
    sandboxes: list[Any], home: Path, baseline_mib: float, pool: ThreadPoolExecutor
) -> dict[str, Any]:
    """Every guest drops its page cache; host memory and the VMMs' USS before and after."""
    before, uss_before = used_mib(baseline_mib), uss_sum_mib(home)
    parts_before = vmm_parts_mib(home)
    list(pool.map(lambda s: s.commands.run(TRIM, user="root", request_timeout=60), sandboxes))
    time.sleep(SETTLE_S)
    after, uss_after = used_mib(baseline_mib), uss_sum_mib(home)
    return {
        "vmm_parts_mib_before": parts_before,
        "vmm_parts_mib_after": vmm_parts_mib(home),
        "host_used_mib_before": round(before),
        "host_used_mib_after": round(after),
        "vmm_uss_sum_mib_before": uss_before,
        "vmm_uss_sum_mib_after": uss_after,
        "freed_per_sandbox_mib": round((uss_before - uss_after) / len(sandboxes), 2),
    }


def ksmd_seconds() -> float:
    """CPU seconds ksmd (a kernel thread) has used."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if "(ksmd)" in text:
            fields = text.rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def ksm_window(sandboxes: list[Any], home: Path, baseline_mib: float) -> dict[str, Any]:
    """KSM on for KSM_S seconds (as `ksm = true` configures it); what it merged, host memory
    and the VMMs' USS after, and ksmd's CPU. The host's settings are restored after."""
    ksm = Ksm()
    if not ksm.available():
        return {"available": False}
    before, uss_before = used_mib(baseline_mib), uss_sum_mib(home)
    start, cpu_start = ksm.stats(), ksmd_seconds()
    try:
        ksm.enable(KsmSettings())
        time.sleep(KSM_S)
        stats, cpu_end = ksm.stats(), ksmd_seconds()
        ours = sum(merged_pages(proc.pid) for proc in vmm_processes(home))
        after, uss_after = used_mib(baseline_mib), uss_sum_mib(home)
    finally:
        ksm.restore()
    n = len(sandboxes)
    return {
        "available": True,
        "seconds": KSM_S,
        "full_scans": stats.full_scans - start.full_scans,
        "pages_shared": stats.pages_shared,
        "pages_sharing": stats.pages_sharing,
        "zero_pages": stats.zero_pages,
        "saved_mib": round(stats.saved_bytes / MIB),
        # Host-wide figures above include other VMMs on the host; this is the node's own.
        "node_vmm_pages_merged_per_sandbox_mib": round(ours * 4096 / MIB / n, 2),
        "ksmd_cores": round((cpu_end - cpu_start) / KSM_S, 3),
        "host_used_mib_before": round(before),
        "host_used_mib_after": round(after),
        "vmm_uss_sum_mib_before": uss_before,
        "vmm_uss_sum_mib_after": uss_after,
        "host_used_per_sandbox_mib_after": round(after / n, 1),
        "overcommit_after": round(n * GUEST_MB / after, 2) if after > 0 else None,
        "probe_after": probe(sandboxes),
    }


def client() -> None:
    from e2b import Sandbox

    client_env()
    mode = os.environ["AENV_BENCH_DENSITY_MODE"]
    limit = MAX if mode == "default" else TB_N
    home = Path(os.environ["AENV_HOME"])
    baseline = available_mib()
    sandboxes: list[Any] = []
    steps: list[dict[str, Any]] = []
    stopped = f"reached {limit}"
    result: dict[str, Any] = {}
    with ThreadPoolExecutor(4) as pool:
        while len(sandboxes) < limit:
            # The small_tb phase compares with the default phase's step of TB_N sandboxes.
            want = min(STEP if mode == "default" else TB_N, limit - len(sandboxes))
            if mode == "default" and len(sandboxes) < TB_N < len(sandboxes) + want:
                want = TB_N - len(sandboxes)
            # A step must not cross the floor: sandboxes grow after their create (first
            # commands, page copies), so a step is sized by what the last ones cost, with room.
            # On a shared host the MemAvailable drop can be negative (other jobs freed memory):
            # never size a step by less than what the node's own VMMs hold.
            last = steps[-1] if steps else {}
            each = 1.5 * max(
                last.get("host_used_per_sandbox_mib", 64), last.get("vmm_uss_mib_median", 64)
            )
            want = min(want, int((available_mib() - FLOOR_MB) / each))
            if want <= 0:
                stopped = f"host available memory near {FLOOR_MB} MiB"
                break
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
            if len(sandboxes) == TB_N:  # both phases: every sandbox, for the TB comparison
                steps[-1]["probe_all"] = probe(sandboxes, share=1.0)
            log(f"{mode}: {len(sandboxes)} sandboxes: {json.dumps(steps[-1])}")
            if failed:
                break
            if not steps[-1]["probe"]["all_within_5s"]:
                stopped = "sampled commands no longer all answered within 5 s"
                break
        if mode == "default" and sandboxes:
            result["cpu_by_thread"] = thread_cpu(home)
            # A trim costs memory here (+30 MiB a guest, docs/density.md): near the floor it
            # would run the host out of memory.
            room = available_mib() - FLOOR_MB
            if room > TRIM_COST_MIB * len(sandboxes):
                result["trim"] = trim(sandboxes, home, baseline, pool)
            else:
                result["trim"] = {"skipped": f"{room:.0f} MiB above the floor: too little"}
            log(f"trim: {json.dumps(result['trim'])}")
            result["ksm"] = ksm_window(sandboxes, home, baseline)
            log(f"ksm: {json.dumps(result['ksm'])}")
        list(pool.map(lambda s: s.kill(), sandboxes))
    print(json.dumps({"steps": steps, "stopped": stopped, **result}))


def phase(mode: str, tb_mib: int, limit: int) -> dict[str, Any]:
    env = {
        "AENV_SANDBOX_MEMORY_MB": str(GUEST_MB),
        "AENV_MAX_SANDBOXES": str(limit + 8),
        "AENV_KEY_MAX_SANDBOXES": str(limit + 8),
        "AENV_TCG_TB_MIB": str(tb_mib),
        "AENV_BENCH_DENSITY_MODE": mode,
    }
    with bench_server(env) as server:
        result = run_client(server, [sys.executable, __file__, "--client"], timeout=7200)
        result["machine"] = describe(server)
    result["tcg_tb_mib"] = tb_mib
    # The node's `ksm` setting comes from the environment the bench runs in (AENV_KSM).
    result["ksm_during_climb"] = os.environ.get("AENV_KSM", "").lower() in ("1", "true", "yes")
    return result


def small_tb_ratios(default: dict[str, Any], small: dict[str, Any]) -> dict[str, Any]:
    """The small translation cache against the default phase at the same sandbox count."""
    same = [s for s in default["steps"] if s["sandboxes"] == TB_N]
    if not same or not small["steps"]:
        return {}
    base, tb = same[0], small["steps"][-1]
    return {
        "sandboxes": TB_N,
        "uss_mib_median": [base["vmm_uss_mib_median"], tb["vmm_uss_mib_median"]],
        "probe_p50_ms": [base["probe_all"]["p50_ms"], tb["probe_all"]["p50_ms"]],
        "uss_ratio": round(tb["vmm_uss_mib_median"] / base["vmm_uss_mib_median"], 3),
        "probe_p50_ratio": round(tb["probe_all"]["p50_ms"] / base["probe_all"]["p50_ms"], 3),
        "idle_cores_per_sandbox": [base["idle_cores_per_sandbox"], tb["idle_cores_per_sandbox"]],
    }


def uss_sum(step: dict[str, Any]) -> float:
    """The node's VMMs' summed USS at a step (median times count in runs that did not sum it)."""
    if "vmm_uss_sum_mib" in step:
        return float(step["vmm_uss_sum_mib"])
    return float(step["vmm_uss_mib_median"] * step["sandboxes"])


def plot(default: dict[str, Any], small: dict[str, Any]) -> None:
    """Memory and idle CPU against sandboxes held, each technique on and off. Memory is what
    the node's VMMs hold alone (USS, summed), which other work on the host does not move, and
    the host-wide drop of MemAvailable, which it does."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, cpu) = plt.subplots(1, 2, figsize=(11, 4.2))
    steps, tb_steps = default["steps"], small["steps"]
    xs = [s["sandboxes"] for s in steps]
    default_tb = f"{default.get('tcg_tb_mib', TCG_TB_MIB)} MiB TB"
    climb = "KSM on" if default.get("ksm_during_climb") else "all off"
    mem.plot(xs, [uss_sum(s) for s in steps], "o-", label=f"VMMs' USS, {climb} ({default_tb})")
    mem.plot(xs, [s["host_used_mib"] for s in steps], ".--", label="host-wide used (noisy)")
    top = xs[-1] if xs else 0
    for key, label, marker in (("trim", "+ page-cache trim", "s"), ("ksm", "+ KSM", "^")):
        if "vmm_uss_sum_mib_after" in default.get(key, {}):
            mem.plot([top], [default[key]["vmm_uss_sum_mib_after"]], marker, label=label)
    tb_x = [s["sandboxes"] for s in tb_steps]
    tb_label = f"VMMs' USS, {small.get('tcg_tb_mib', TB_MIB)} MiB TB"
    mem.plot(tb_x, [uss_sum(s) for s in tb_steps], "x", label=tb_label)
    mem.set_xlabel("idle sandboxes held (512 MiB guests; nominal 512 MiB each)")
    mem.set_ylabel("memory, MiB")
    mem.legend(fontsize=8)
    cpu.plot(xs, [s["idle_cores"] for s in steps], "o-", label=default_tb)
    cpu.plot(tb_x, [s["idle_cores"] for s in tb_steps], "x", label=tb_label.split(", ")[1])
    cpu.set_xlabel("idle sandboxes held")
    cpu.set_ylabel("host CPU of the VMMs, cores")
    cpu.legend(fontsize=8)
    fig.suptitle("bench/density.py: QEMU TCG, 2 cores, 24 GiB")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=100)


def main() -> None:
    default = phase("default", TCG_TB_MIB, MAX)
    try:
        small = phase("small_tb", TB_MIB, TB_N)
    except RuntimeError as error:  # the default phase's figures are still worth printing
        small = {"steps": [], "error": str(error)[-2000:]}
    plot(default, small)
    print(
        json.dumps(
            {
                "benchmark": "density",
                "date": time.strftime("%Y-%m-%d"),
                **default.pop("machine"),
                "default": default,
                "small_tb": small,
                "small_tb_vs_default": small_tb_ratios(default, small),
                "plot": str(PLOT),
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        client()
    elif sys.argv[1:2] == ["--plot"]:  # redraw from a run's JSON output: --plot run.json
        saved = json.loads(Path(sys.argv[2]).read_text())
        plot(saved["default"], saved["small_tb"])
    else:
        main()
