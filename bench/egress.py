"""Egress rules and proxies (bench/network.py runs this part with `--part egress`): the same
downloads and connections from a guest with no rules, with domain rules, and through a SOCKS5
proxy of its own (`egressProxy`, a real microsocks in the "internet"), in one run.

- a 256 MiB HTTP download: throughput through the slot's egress proxy (judging names, or
  tunneling to the SOCKS5 proxy) over the direct path;
- connection setup (connect to first byte of a small response), median and p99, each path;
- the slot side of `update_network`: `set_policy` alternating between address rules and
  domain rules (the domain proxy and DNS forwarder start and stop each time).

The guest is a fake guest (tests/network/fakeguest.py) in a process of its own, so its frame
pump does not share the interpreter with the proxy; the web server is `python -m http.server`
in the "internet" namespace; curl is the client. All namespaces are made here and removed.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.synchronize
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from summary import summary_ms

from aenv.network import EgressPolicy, Slot, SlotPool, netns
from aenv.network.socks import SocksProxy
from tests.network.conftest import INET_IP, World, new_world
from tests.network.fakeguest import FakeGuest
from tests.support import socks_server

FILE_MIB = 256
SMALL_RUNS = 200
POLICY_RUNS = 100
DOMAINS = EgressPolicy.parse(allow=["files.test"], deny=["0.0.0.0/0"])
ADDRESSES = EgressPolicy.parse(allow=[INET_IP], deny=["0.0.0.0/0"])
SOCKS_IP = "198.51.100.80"
TUNNELED = EgressPolicy(
    proxy=SocksProxy(SOCKS_IP, socks_server.PORT, socks_server.USER, socks_server.PASSWORD)
)
PATHS = {"direct": EgressPolicy(), "domain_rules": DOMAINS, "socks_proxy": TUNNELED}


def _guest_process(slot: Slot, ready: multiprocessing.synchronize.Event) -> None:
    async def run() -> None:
        guest = FakeGuest(slot)
        await guest.start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(run())


def _curl(ns: str, url: str, fmt: str) -> float:
    out = subprocess.run(
        ["nsenter", f"--net=/run/netns/{ns}", "--", "curl", "-s", "-o", "/dev/null",
         "-H", "Host: files.test", "-w", fmt, url],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return float(out)


def _wait_listening(ns: str) -> None:
    for _ in range(100):
        try:
            _curl(ns, f"http://{INET_IP}:8000/small", "%{http_code}")
            return
        except subprocess.CalledProcessError:
            time.sleep(0.1)
    raise RuntimeError("the web server did not start")


async def _paths(pool: SlotPool, slot: Slot, guest_ns: str) -> dict[str, object]:
    """Download and connection setup on each path; ratios and overheads against direct."""
    big, small = f"http://{INET_IP}:8000/big", f"http://{INET_IP}:8000/small"
    result: dict[str, object] = {}
    speeds: dict[str, float] = {}
    setups: dict[str, list[float]] = {}
    for name, policy in PATHS.items():
        await pool.set_policy(slot, policy)
        speeds[name] = await asyncio.to_thread(_curl, guest_ns, big, "%{speed_download}")
        setups[name] = [
            await asyncio.to_thread(_curl, guest_ns, small, "%{time_starttransfer}")
            for _ in range(SMALL_RUNS)
        ]
        result[f"download_{name}_mib_s"] = round(speeds[name] / 2**20, 1)
        result[f"setup_{name}_ms"] = summary_ms(setups[name])
    median = {name: statistics.median(samples) for name, samples in setups.items()}
    for name in ("domain_rules", "socks_proxy"):
        result[f"download_ratio_{name}"] = round(speeds[name] / speeds["direct"], 3)
        overhead = (median[name] - median["direct"]) * 1e3
        result[f"setup_overhead_{name}_median_ms"] = round(overhead, 3)
    return result


async def _policy_switches(pool: SlotPool, slot: Slot) -> dict[str, object]:
    samples = []
    for i in range(POLICY_RUNS):
        start = time.perf_counter()
        await pool.set_policy(slot, DOMAINS if i % 2 else ADDRESSES)
        samples.append(time.perf_counter() - start)
    return {"set_policy_switch_ms": summary_ms(samples)}


async def _bench(world: World) -> dict[str, object]:
    pool = SlotPool(world.config())
    await pool.start()
    slot = await pool.acquire()
    ready = multiprocessing.get_context("spawn").Event()
    guest = multiprocessing.get_context("spawn").Process(target=_guest_process, args=(slot, ready))
    guest.start()
    try:
        await asyncio.to_thread(ready.wait, 30)
        paths = await _paths(pool, slot, f"{slot.netns}-guest")
        switches = await _policy_switches(pool, slot)
    finally:
        guest.terminate()
        guest.join()
        guest_ns = f"{slot.netns}-guest"
        if guest_ns in netns.names():
            netns.remove(guest_ns)
        await pool.close()
    return {"file_mib": FILE_MIB, "small_runs": SMALL_RUNS, **paths, **switches}


def run() -> dict[str, object]:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as files, new_world() as world:
        Path(files, "small").write_bytes(b"x" * 1024)
        with Path(files, "big").open("wb") as out:
            for _ in range(FILE_MIB):
                out.write(b"\0" * 2**20)
        web = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{world.inet}", "--", "python3", "-m", "http.server",
             "--bind", INET_IP, "--directory", files, "8000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        subprocess.run(
            ["ip", "-n", world.inet, "addr", "add", f"{SOCKS_IP}/32", "dev", "lo"], check=True
        )
        try:
            _wait_listening(world.inet)
            with socks_server.socks_server(world.inet, SOCKS_IP, SOCKS_IP, {}):
                return asyncio.run(_bench(world))
        finally:
            web.terminate()
            web.wait()
