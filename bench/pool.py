"""Warm pools (issue 16): a real `aenv server` with real VMs, driven by the unmodified `e2b`
Python SDK from inside the server's network namespace (see server_ns.py), run twice in one
invocation: pools off (`AENV_POOL_MAX=0`, every create restores: today's path, a miss), then
on (`AENV_POOL_MAX` = AENV_BENCH_POOL_MAX).

- `Sandbox.create()` to the first `commands.run("true")` result, sequential runs. With pools
  on, each run waits (untimed) until the pool holds a VM, so every timed create is a hit: the
  steady state of a node whose pool keeps up with its creates. The ratio hit / miss is the
  figure; the server's own hit and miss counters confirm what each run was;
- where a sequential create's time goes: `Sandbox.create()` returned, then the first command,
  then a second one in the same sandbox (what a command costs once the sandbox's connection
  and guest code are warm), and from the server's log its take of a pooled VM: the egress
  rules put on its slot and envd `/init`;
- creates per second sustained: a few workers each looping create + `run("true")` + kill for a
  while, with the pool's hits and misses over that time (a pool refills only once creates
  paused for a second, so creates back to back miss and take today's path).

Every figure is min / median / p99 / max in ms. Settings (environment): AENV_BENCH_POOL_MAX (2),
AENV_BENCH_CREATE_RUNS (20), AENV_BENCH_SUSTAIN_S (60), AENV_BENCH_SUSTAIN_WORKERS (2). Prints
one JSON document on stdout; progress goes to stderr.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from server import create_and_run, kill_all
from server_ns import (
    bench_server,
    client_env,
    describe,
    entry,
    log,
    metric,
    report,
    run_client,
    wait_until,
)
from summary import summary_ms


def setting(name: str, default: float) -> float:
    return float(os.environ.get(f"AENV_BENCH_{name}", default))


POOL_MAX = int(setting("POOL_MAX", 2))
CREATE_RUNS = int(setting("CREATE_RUNS", 20))
SUSTAIN_S = setting("SUSTAIN_S", 60)
SUSTAIN_WORKERS = int(setting("SUSTAIN_WORKERS", 2))


def pool_counts() -> dict[str, float]:
    return {k: metric(f"aenv_pool_{k}_total") for k in ("hits", "misses", "refills")}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def second_command(sandbox_id: str) -> float:
    """Seconds a second `commands.run("true")` in the sandbox takes."""
    from e2b import Sandbox

    sbx = Sandbox.connect(sandbox_id)
    start = time.perf_counter()
    sbx.commands.run("true")
    return time.perf_counter() - start


def takes_ms(home: Path) -> dict[str, Any]:
    """The server log's pooled-VM takes: egress rules and envd `/init`, ms each."""
    text = (home / "server.log").read_text(errors="replace")
    found = re.findall(r"pool hit \S+: egress (\S+) ms, /init (\S+) ms", text)
    if not found:
        return {}
    return {
        "egress_ms": summary_ms([float(e) / 1000 for e, _ in found]),
        "init_ms": summary_ms([float(i) / 1000 for _, i in found]),
    }


def sequential(pooled: bool) -> dict[str, Any]:
    before = pool_counts()
    creates, firsts, seconds, totals = [], [], [], []
    for _ in range(CREATE_RUNS):
        if pooled:
            wait_until(lambda: metric("aenv_pool_vms") >= 1, 300)
        sandbox_id, created, total = create_and_run()
        creates.append(created)
        firsts.append(total - created)
        totals.append(total)
        seconds.append(second_command(sandbox_id))
        kill_all([sandbox_id])
    log(f"  create to first command median {statistics.median(totals) * 1000:.0f} ms")
    return {
        "runs": CREATE_RUNS,
        "create_ms": summary_ms(creates),
        "first_command_ms": summary_ms(firsts),
        "second_command_ms": summary_ms(seconds),
        "create_to_first_command_ms": summary_ms(totals),
        "take": takes_ms(Path(os.environ["AENV_HOME"])),
        "load_average": os.getloadavg(),
        "pool": delta(before, pool_counts()),
    }


def sustained() -> dict[str, Any]:
    before = pool_counts()
    stop = time.monotonic() + SUSTAIN_S
    done: list[float] = []
    failures: list[str] = []

    def worker() -> None:
        while time.monotonic() < stop:
            try:
                sandbox_id, _, total = create_and_run()
                kill_all([sandbox_id], workers=1)
                done.append(total)
            except Exception as e:  # reported: a failed create is a result too
                failures.append(repr(e)[:300])

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(SUSTAIN_WORKERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    log(f"  {len(done) / elapsed:.2f} creates/s")
    return {
        "workers": SUSTAIN_WORKERS,
        "seconds": round(elapsed, 1),
        "creates": len(done),
        "creates_per_s": round(len(done) / elapsed, 3),
        "create_to_first_command_ms": summary_ms(done) if done else None,
        "failures": failures[:5],
        "pool": delta(before, pool_counts()),
    }


def client() -> None:
    client_env()
    pooled = int(os.environ["AENV_POOL_MAX"]) > 0
    log(f"pool max {os.environ['AENV_POOL_MAX']}: warm-up, then {CREATE_RUNS} sequential...")
    kill_all([create_and_run()[0]])  # the template's files in the page cache
    result = {"sequential": sequential(pooled)}
    log(f"sustained creates for {SUSTAIN_S:.0f} s, {SUSTAIN_WORKERS} workers...")
    result["sustained"] = sustained()
    print(json.dumps(result))


def main() -> None:
    runs: dict[str, Any] = {}
    machine: dict[str, Any] = {}
    for name, pool_max in (("miss", 0), ("hit", POOL_MAX)):
        with bench_server({"AENV_POOL_MAX": str(pool_max)}) as server:
            runs[name] = run_client(server, [sys.executable, __file__, "--client"], timeout=3600)
            machine = describe(server)
    p50 = {k: runs[k]["sequential"]["create_to_first_command_ms"]["median"] for k in runs}
    sustained = [runs[run]["sustained"]["creates_per_s"] for run in ("hit", "miss")]
    report(
        "pool",
        **machine,
        pool_max=POOL_MAX,
        **runs,
        ratio_hit_over_miss_p50=round(p50["hit"] / p50["miss"], 3),
        ratio_sustained_creates_per_s=round(sustained[0] / sustained[1], 3),
    )


if __name__ == "__main__":
    entry(main, client)
