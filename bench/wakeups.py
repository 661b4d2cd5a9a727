"""What wakes an idle guest: the timer callbacks and interrupts of one idle sandbox over a window.

Under emulation (TCG) every guest wakeup is emulated on the host, so an idle sandbox costs what
its wakeups cost (bench/idle.py measures the CPU). This bench starts a real server
(bench/server_ns.py), creates one sandbox from `base`, lets it settle, then traces inside the
guest for AENV_BENCH_WAKEUPS_S seconds (default 20): the kernel's `timer_expire_entry`,
`hrtimer_expire_entry`, `irq_handler_entry`, `workqueue_execute_start` and `netif_receive_skb`
events (tracefs) and the local timer interrupts
(`LOC` of /proc/interrupts). The traced command is one shell that sleeps through the window, so
its own wakeups are two (start and end). Prints JSON: each event and callback, handler or
device with how many times a second it ran, most frequent first.
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
import time
from typing import Any

from server_ns import bench_server, client_env, describe, entry, log, report, run_client

WINDOW_S = int(os.environ.get("AENV_BENCH_WAKEUPS_S", "20"))
SETTLE_S = 10.0
TRACING = "/sys/kernel/tracing"
EVENTS = (
    "timer/timer_expire_entry",
    "timer/hrtimer_expire_entry",
    "irq/irq_handler_entry",
    "workqueue/workqueue_execute_start",
    "net/netif_receive_skb",
)
TRACE = f"""
mountpoint -q {TRACING} || mount -t tracefs nodev {TRACING}
echo 0 > {TRACING}/tracing_on; echo > {TRACING}/trace; echo 4096 > {TRACING}/buffer_size_kb
for e in {" ".join(EVENTS)}; do echo 1 > {TRACING}/events/$e/enable; done
grep LOC /proc/interrupts; echo 1 > {TRACING}/tracing_on
sleep {WINDOW_S}
echo 0 > {TRACING}/tracing_on; grep LOC /proc/interrupts
cat {TRACING}/trace
"""
# `timer_expire_entry: ... function=tick_sched_timer`, `irq_handler_entry: irq=24 name=virtio3`,
# `workqueue_execute_start: work struct ...: function vmstat_update`, `netif_receive_skb: dev=eth0
# skbaddr=... len=52`: the event and what ran (or the device a packet came in on).
_WHAT = re.compile(r"([a-z_]+): .*?(?:function[= ]|name=|dev=)(\S+)")


def wakeups(trace: str) -> dict[str, Any]:
    lines = trace.splitlines()
    loc = [line for line in lines if line.strip().startswith("LOC:")]
    counts = [sum(int(v) for v in line.split()[1:] if v.isdigit()) for line in loc[:2]]
    seen: collections.Counter[str] = collections.Counter()
    for line in lines:
        if match := _WHAT.search(line):
            seen[f"{match.group(1)}:{match.group(2)}"] += 1
    return {
        "local_timer_irqs_per_s": round((counts[1] - counts[0]) / WINDOW_S, 2),
        "per_s": {what: round(n / WINDOW_S, 2) for what, n in seen.most_common()},
    }


def client() -> None:
    from e2b import Sandbox

    client_env()
    sbx = Sandbox.create(timeout=600)
    log(f"one idle sandbox; settling {SETTLE_S:.0f} s, then tracing {WINDOW_S} s")
    time.sleep(SETTLE_S)
    out = sbx.commands.run(TRACE, user="root", timeout=WINDOW_S + 60).stdout
    sbx.kill()
    print(json.dumps({"window_s": WINDOW_S, **wakeups(out)}))


def main() -> None:
    with bench_server() as server:
        result = run_client(server, [sys.executable, __file__, "--client"], timeout=1800)
        machine = describe(server)
    report("wakeups", **machine, **result)


if __name__ == "__main__":
    entry(main, client)
