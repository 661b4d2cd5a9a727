"""Egress rules and proxies (bench/network.py runs this part with `--part egress`): the same
downloads and connections from a guest with no rules, with domain rules, and through a SOCKS5
proxy of its own (`egressProxy`, a real microsocks in the "internet"), in one run.

- a 256 MiB HTTP download: throughput through the slot's egress proxy (judging names, or
  tunneling to the SOCKS5 proxy) over the direct path;
- connection setup (connect to first byte of a small response), median and p99, each path;
- the slot side of `update_network`: `set_policy` alternating between address rules and
  domain rules (the domain proxy and DNS forwarder start and stop each time);
- header rules (`network.rules`): the same 256 MiB download and connection setup over HTTPS
  (TLS handshake included), intercepted by the slot's egress proxy (a rule for the name) over
  passed through (the name allowed, no rule). Targets: setup <= 1.2x, throughput >= 0.8x.
  Beside each download, the CPU time the slot's proxy took for it (this process's, where the
  proxy runs: the guest, curl and the servers are processes of their own), which the
  machine's load changes far less than the speeds.

The proxy runs on uvloop, as in the server (`aenv.serving`). The guest is a fake guest
(tests/network/fakeguest.py) in a process of its own, so its frame pump does not share the
interpreter with the proxy; the web server is `python -m http.server`
in the "internet" namespace (over TLS for header rules, with a certificate of a trustme CA the
node trusts); curl is the client. All namespaces are made here and removed.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.synchronize
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trustme
import uvloop
from summary import summary_ms

from aenv.network import EgressPolicy, Slot, SlotPool, netns
from aenv.network.egress_ca import CA_CERT
from aenv.network.header_rules import HeaderRule, HeaderRules
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
TLS_PORT = 8443
DOWNLOADS = 3  # per HTTPS path, taking turns; the median counts
RULES = HeaderRules((HeaderRule("files.test", (("X-Api-Key", "bench"),)),))
RULED = EgressPolicy.parse(allow=["files.test"], deny=["0.0.0.0/0"], headers=RULES)
# Path -> its policy and curl's protocol. The file server speaks HTTP/1.1, so a passed-through
# connection is HTTP/1.1 whatever curl offers; an intercepted one speaks what curl chose to the
# proxy (HTTP/2 by default) and HTTP/1.1 to the server.
TLS_PATHS = {
    "passed_through": (DOMAINS, "--http1.1"),
    "intercepted": (RULED, "--http1.1"),
    "intercepted_h2": (RULED, "--http2"),
}
# A file server over TLS: `python -m http.server` has no TLS of its own.
_TLS_SERVER = """
import functools, http.server, ssl, sys
directory, address, port, pem = sys.argv[1:]
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=directory)
handler.log_message = lambda *args: None
server = http.server.ThreadingHTTPServer((address, int(port)), handler)
context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
context.load_cert_chain(pem)
server.socket = context.wrap_socket(server.socket, server_side=True)
server.serve_forever()
"""


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


def _wait_tls(ns: str) -> None:
    for _ in range(100):
        probe = subprocess.run(
            ["nsenter", f"--net=/run/netns/{ns}", "--", "curl", "-sk", "-o", "/dev/null",
             f"https://{INET_IP}:{TLS_PORT}/small"],
            check=False,
        )  # fmt: skip
        if probe.returncode == 0:
            return
        time.sleep(0.1)
    raise RuntimeError("the TLS web server did not start")


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


def _curl_tls(ns: str, bundle: Path, protocol: str, path: str, fmt: str) -> float:
    out = subprocess.run(
        ["nsenter", f"--net=/run/netns/{ns}", "--", "curl", "-sS", "-o", "/dev/null", protocol,
         "--cacert", str(bundle), "--resolve", f"files.test:{TLS_PORT}:{INET_IP}",
         "-w", fmt, f"https://files.test:{TLS_PORT}/{path}"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return float(out)


async def _header_rules(
    pool: SlotPool, slot: Slot, guest_ns: str, bundle: Path
) -> dict[str, object]:
    """HTTPS download and setup (a new connection, TLS included), intercepted for a header
    rule over passed through. The two paths take turns, sample by sample, so that a load that
    comes and goes on a shared machine weighs on both alike."""
    result: dict[str, object] = {}
    speeds: dict[str, list[float]] = {name: [] for name in TLS_PATHS}
    setups: dict[str, list[float]] = {name: [] for name in TLS_PATHS}
    cpu: dict[str, list[float]] = {name: [] for name in TLS_PATHS}
    for _ in range(DOWNLOADS):
        for name, (policy, protocol) in TLS_PATHS.items():
            await pool.set_policy(slot, policy)
            before = time.process_time()
            speeds[name].append(
                await asyncio.to_thread(
                    _curl_tls, guest_ns, bundle, protocol, "big", "%{speed_download}"
                )
            )
            cpu[name].append(time.process_time() - before)
    for _ in range(SMALL_RUNS):
        for name, (policy, protocol) in TLS_PATHS.items():
            await pool.set_policy(slot, policy)
            setups[name].append(
                await asyncio.to_thread(
                    _curl_tls, guest_ns, bundle, protocol, "small", "%{time_starttransfer}"
                )
            )
    for name in TLS_PATHS:
        result[f"https_download_{name}_mib_s"] = [round(v / 2**20, 1) for v in speeds[name]]
        result[f"https_download_{name}_proxy_cpu_s"] = [round(v, 3) for v in cpu[name]]
        result[f"https_setup_{name}_ms"] = summary_ms(setups[name])
    speed = {name: statistics.median(values) for name, values in speeds.items()}
    setup = {name: statistics.median(values) for name, values in setups.items()}
    for name in ("intercepted", "intercepted_h2"):
        result[f"https_download_ratio_{name}"] = round(speed[name] / speed["passed_through"], 3)
        result[f"https_setup_ratio_{name}"] = round(setup[name] / setup["passed_through"], 3)
    return result


async def _policy_switches(pool: SlotPool, slot: Slot) -> dict[str, object]:
    samples = []
    for i in range(POLICY_RUNS):
        start = time.perf_counter()
        await pool.set_policy(slot, DOMAINS if i % 2 else ADDRESSES)
        samples.append(time.perf_counter() - start)
    return {"set_policy_switch_ms": summary_ms(samples)}


async def _bench(world: World, origin_ca: Path, node_ca: Path) -> dict[str, object]:
    pool = SlotPool(world.config(egress_ca=node_ca, upstream_ca=origin_ca))
    await pool.start()
    slot = await pool.acquire()
    ready = multiprocessing.get_context("spawn").Event()
    guest = multiprocessing.get_context("spawn").Process(target=_guest_process, args=(slot, ready))
    guest.start()
    try:
        await asyncio.to_thread(ready.wait, 30)
        paths = await _paths(pool, slot, f"{slot.netns}-guest")
        bundle = node_ca.parent / "bundle.pem"
        bundle.write_bytes(origin_ca.read_bytes() + (node_ca / CA_CERT).read_bytes())
        rules = await _header_rules(pool, slot, f"{slot.netns}-guest", bundle)
        switches = await _policy_switches(pool, slot)
    finally:
        guest.terminate()
        guest.join()
        guest_ns = f"{slot.netns}-guest"
        if guest_ns in netns.names():
            netns.remove(guest_ns)
        await pool.close()
    return {"file_mib": FILE_MIB, "small_runs": SMALL_RUNS, **paths, **rules, **switches}


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
        origin = trustme.CA()
        keys = Path(tempfile.mkdtemp(prefix="aenv-bench-ca-"))
        origin.cert_pem.write_to_path(str(keys / "origin.pem"))
        origin.issue_cert("files.test").private_key_and_cert_chain_pem.write_to_path(
            str(keys / "server.pem")
        )
        tls_web = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{world.inet}", "--", sys.executable, "-c",
             _TLS_SERVER, files, INET_IP, str(TLS_PORT), str(keys / "server.pem")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        subprocess.run(
            ["ip", "-n", world.inet, "addr", "add", f"{SOCKS_IP}/32", "dev", "lo"], check=True
        )
        try:
            _wait_listening(world.inet)
            _wait_tls(world.inet)
            with socks_server.socks_server(world.inet, SOCKS_IP, SOCKS_IP, {}):
                return uvloop.run(_bench(world, keys / "origin.pem", keys / "node-ca"))
        finally:
            for server in (web, tls_web):
                server.terminate()
                server.wait()
            shutil.rmtree(keys)
