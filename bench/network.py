"""Network slot benchmarks: slot setup cold vs from the warm pool, egress switching, teardown.

- cold: `SlotPool.acquire()` on an empty pool (netns, tap, veth, addresses, routes, one nft batch);
- warm: `acquire()` from a filled pool (the baseline the cold figure is compared with);
- warm with the non-default egress verdict (one nft batch inside the slot);
- `set_egress` on a live slot;
- `set_policy` on a live slot: the first policy (the slot's sets only grow) and a change (the
  sets are flushed first);
- release (what the caller waits for) and the time until the kernel has removed the released
  slots' host interfaces (it does that in the background, in batches);
- refilling the pool in the background: total and per slot.

The host side runs in a namespace this script creates (and removes), never in the machine's root
namespace. Needs root. Prints one JSON document. `--part egress` measures domain egress rules
instead (bench/egress.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from ipaddress import IPv4Network
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import egress
from summary import summary_ms

from aenv.network import EgressPolicy, NetworkConfig, Slot, SlotPool, netns

T = TypeVar("T")


async def timed(fn: Callable[[], Awaitable[T]]) -> tuple[T, float]:
    start = time.perf_counter()
    result = await fn()
    return result, time.perf_counter() - start


def host_slot_links(host: str, prefix: str) -> int:
    out = subprocess.run(
        ["ip", "-n", host, "-o", "link"], check=True, capture_output=True, text=True
    ).stdout
    return sum(f": {prefix}-" in line for line in out.splitlines())


async def bench(host: str, prefix: str, runs: int) -> dict[str, object]:
    base = NetworkConfig(prefix=prefix, host_netns=host, slot_network=IPv4Network("10.200.0.0/20"))

    cold_pool = SlotPool(NetworkConfig(**{**base.__dict__, "pool_low": 0, "pool_high": 0}))
    await cold_pool.start()
    cold: list[float] = []
    slots: list[Slot] = []
    for _ in range(runs):
        slot, took = await timed(cold_pool.acquire)
        cold.append(took)
        slots.append(slot)
    toggles: list[float] = []
    for i, slot in enumerate(slots):
        _, took = await timed(partial(cold_pool.set_egress, slot, bool(i % 2)))
        toggles.append(took)
    first_policy: list[float] = []
    policy_change: list[float] = []
    deny_all = EgressPolicy.parse(deny=["0.0.0.0/0"])
    allow_one = EgressPolicy.parse(allow=["1.1.1.1"], deny=["0.0.0.0/0"])
    for slot in slots:
        _, took = await timed(partial(cold_pool.set_policy, slot, deny_all))
        first_policy.append(took)
        _, took = await timed(partial(cold_pool.set_policy, slot, allow_one))
        policy_change.append(took)
    releases: list[float] = []
    start = time.perf_counter()
    for slot in slots:
        _, took = await timed(partial(cold_pool.release, slot))
        releases.append(took)
    while host_slot_links(host, prefix):
        await asyncio.sleep(0.002)
    drained = time.perf_counter() - start
    await cold_pool.close()

    # pool_low 0: nothing refills while acquires are measured.
    warm_pool = SlotPool(NetworkConfig(**{**base.__dict__, "pool_low": 0, "pool_high": 2 * runs}))
    start = time.perf_counter()
    await warm_pool.start()
    await warm_pool.wait_idle()
    refill = time.perf_counter() - start
    warm: list[float] = []
    warm_other_egress: list[float] = []
    for _ in range(runs):
        _, took = await timed(warm_pool.acquire)
        warm.append(took)
        _, took = await timed(partial(warm_pool.acquire, egress=not base.egress))
        warm_other_egress.append(took)
    await warm_pool.close()

    return {
        "runs": runs,
        "setup_cold_ms": summary_ms(cold),
        "setup_warm_ms": summary_ms(warm),
        "setup_warm_other_egress_ms": summary_ms(warm_other_egress),
        "cold_over_warm_median": round(statistics.median(cold) / statistics.median(warm), 1),
        "set_egress_ms": summary_ms(toggles),
        "set_policy_first_ms": summary_ms(first_policy),
        "set_policy_change_ms": summary_ms(policy_change),
        "release_ms": summary_ms(releases),
        "release_all_until_host_interfaces_gone_ms": round(drained * 1000, 3),
        "pool_fill_ms": {
            "slots": 2 * runs,
            "total": round(refill * 1000, 3),
            "per_slot": round(refill * 1000 / (2 * runs), 3),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--part", choices=["slots", "egress"], default="slots")
    args = parser.parse_args()
    if args.part == "egress":
        print(json.dumps(egress.run(), indent=2))
        return
    tag = secrets.token_hex(3)
    host, prefix = f"aenv-bench-host-{tag}", f"b{tag}"
    subprocess.run(["ip", "netns", "add", host], check=True)
    try:
        subprocess.run(["ip", "-n", host, "link", "set", "lo", "up"], check=True)
        result = asyncio.run(bench(host, prefix, args.runs))
    finally:
        for name in netns.names():
            if name == host or name.startswith(f"{prefix}-"):
                netns.remove(name)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
