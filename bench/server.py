"""Server benchmarks (issue 4): a real `aenv server` with real VMs, driven by the unmodified
`e2b` Python SDK from inside the server's network namespace (see server_ns.py).

- `Sandbox.create()` to the first `commands.run("true")` result: sequential runs, then a burst
  of concurrent ones (threads); the admission queue's peak as `/metrics` showed it (polled);
- proxy overhead: `commands.run("true")` through the server's proxy vs straight to the guest's
  envd (runs interleaved), and small HTTP requests per second to a web server in the sandbox,
  through the proxy vs straight to the guest. "Straight to the guest" is the slot address the
  proxy itself forwards to (found by asking each slot's envd `/envs` for its sandbox id);
- creates per second sustained for a while: a few workers each looping create + kill; then the
  CPU one create + kill costs (whole machine, the server process, its children), which bounds
  that rate;
- `GET /v2/sandboxes` latency with many sandboxes: sandboxes are created and paused (a paused
  sandbox costs no CPU, a running one does under TCG) up to a target count, within a time
  budget and half the free disk (a paused sandbox holds its RAM on disk, plus its copy in the
  snapshot repository); the list is timed at milestones on the way (first page with limit=100,
  and all pages, raw HTTP and through the SDK's paginator) once the background repository
  copies have finished, so nothing else runs. Everything is killed at the end.

Every figure is min / median / p99 / max; ratios are against the direct path measured in the
same run. Settings (environment): AENV_BENCH_CREATE_RUNS (10), AENV_BENCH_BURST (50),
AENV_BENCH_PROXY_RUNS (100), AENV_BENCH_HTTP_REQUESTS (2000), AENV_BENCH_SUSTAIN_S (60),
AENV_BENCH_SUSTAIN_WORKERS (4), AENV_BENCH_LIST_N (1000), AENV_BENCH_LIST_BUDGET_S (420),
AENV_BENCH_LIST_WORKERS (4), AENV_BENCH_LIST_PAUSE (filesystem: paused without memory, so
1,000 fit on disk; or memory), AENV_BENCH_CPU_CYCLES (20). Prints one JSON document on stdout;
progress goes to stderr.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from http_load import http_rate
from server_ns import (
    BASE,
    bench_server,
    client_env,
    describe,
    dir_size,
    entry,
    files_mib,
    log,
    report,
    run_client,
    unarchived_pauses,
    wait_until,
)
from summary import percentile, summary_ms

from aenv.config import Paths


def setting(name: str, default: float) -> float:
    return float(os.environ.get(f"AENV_BENCH_{name}", default))


CREATE_RUNS = int(setting("CREATE_RUNS", 10))
BURST = int(setting("BURST", 50))
PROXY_RUNS = int(setting("PROXY_RUNS", 100))
HTTP_REQUESTS = int(setting("HTTP_REQUESTS", 2000))
HTTP_CONCURRENCY = 16
SUSTAIN_S = setting("SUSTAIN_S", 60)
SUSTAIN_WORKERS = int(setting("SUSTAIN_WORKERS", 4))
LIST_N = int(setting("LIST_N", 1000))
LIST_BUDGET_S = setting("LIST_BUDGET_S", 420)
LIST_WORKERS = int(setting("LIST_WORKERS", 4))
CPU_CYCLES = int(setting("CPU_CYCLES", 20))
LIST_PAUSE = os.environ.get("AENV_BENCH_LIST_PAUSE", "filesystem")  # or memory
LIST_REPS = 20
ENVD_PORT = 49983
WEB_PORT = 8000
# A keep-alive web server for the sandbox (`python3 -m http.server` speaks HTTP/1.0 and closes
# every connection, which would measure TCP handshakes through TCG).
WEB_SERVER = f"""
import http.server

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("0.0.0.0", {WEB_PORT}), Handler).serve_forever()
"""


# -- helpers ----------------------------------------------------------------------------------


def timed(op: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = op()
    return time.perf_counter() - start, result


def kill_all(ids: list[str], workers: int = 8) -> float:
    from e2b import Sandbox

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(Sandbox.kill, ids))
    return time.perf_counter() - start


class QueueWatch:
    """Polls `/metrics` for the admission queue gauge (`aenv_create_queue`) and keeps its peak.
    A sample every 50 ms, so a shorter peak can be missed: a lower bound."""

    def __init__(self) -> None:
        self.peak = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> QueueWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import httpx

        with httpx.Client(base_url=BASE, timeout=5) as client:
            while not self._stop.is_set():
                try:
                    text = client.get("/metrics").text
                except httpx.HTTPError:
                    continue
                for line in text.splitlines():
                    if line.startswith("aenv_create_queue "):
                        self.peak = max(self.peak, float(line.split()[1]))
                        self.samples += 1
                self._stop.wait(0.05)


def metric_lines(prefix: str) -> list[str]:
    import httpx

    text = httpx.get(f"{BASE}/metrics", timeout=5).text
    return [line for line in text.splitlines() if line.startswith(prefix)]


# -- create to first command --------------------------------------------------------------------


def create_and_run() -> tuple[str, float, float]:
    """(id, seconds to `create` returned, seconds to the first command's result)."""
    from e2b import Sandbox

    start = time.perf_counter()
    sbx = Sandbox.create(timeout=600)
    created = time.perf_counter()
    result = sbx.commands.run("true")
    done = time.perf_counter()
    assert result.exit_code == 0
    return sbx.sandbox_id, created - start, done - start


def bench_create() -> dict[str, Any]:
    log(f"create to first command: {CREATE_RUNS} sequential...")
    seq_create: list[float] = []
    seq_total: list[float] = []
    for _ in range(CREATE_RUNS):
        sandbox_id, created, total = create_and_run()
        seq_create.append(created)
        seq_total.append(total)
        kill_all([sandbox_id])
    log(f"  median {statistics.median(seq_total) * 1000:.0f} ms; {BURST} concurrent...")
    barrier = threading.Barrier(BURST)

    failures: list[str] = []

    def one(_: int) -> tuple[str, float, float] | None:
        barrier.wait()
        try:
            return create_and_run()
        except Exception as e:  # reported: a failed create is a result too
            failures.append(repr(e)[:300])
            return None

    with QueueWatch() as watch, ThreadPoolExecutor(BURST) as pool:
        wall, answers = timed(lambda: list(pool.map(one, range(BURST))))
    results = [r for r in answers if r is not None]
    kill_s = kill_all([r[0] for r in results])
    log(
        f"  {len(results)} of {BURST} answered after {wall:.1f} s, {len(failures)} failed "
        f"(killed in {kill_s:.1f} s)"
    )
    seq_median = statistics.median(seq_total)
    burst_total = [r[2] for r in results]
    return {
        "sequential": {
            "runs": CREATE_RUNS,
            "create_ms": summary_ms(seq_create),
            "create_to_first_command_ms": summary_ms(seq_total),
        },
        "concurrent": {
            "sandboxes": BURST,
            "create_ms": summary_ms([r[1] for r in results]),
            "create_to_first_command_ms": summary_ms(burst_total),
            "all_answered_s": round(wall, 2),
            "p50_ratio_to_sequential": round(statistics.median(burst_total) / seq_median, 2),
            "admission_queue_peak": watch.peak,
            "queue_samples": watch.samples,
            "kill_all_s": round(kill_s, 2),
            "failure_count": len(failures),
            "failures": failures[:3],
        },
        "create_seconds_histogram": metric_lines("aenv_create_seconds_"),
    }


# -- proxy overhead ----------------------------------------------------------------------------


def guest_address(sbx: Any) -> str:
    """Where the proxy reaches this sandbox: its slot's address, one above the host's end of a
    veth in this namespace. Each candidate's envd says which sandbox it serves (`/envs`)."""
    import httpx

    network = ipaddress.IPv4Network(os.environ["AENV_NETWORK_CIDR"])
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    headers = {"X-Access-Token": sbx._envd_access_token or ""}
    for line in out.splitlines():
        iface = ipaddress.IPv4Interface(line.split()[3])
        if iface.ip not in network:
            continue
        candidate = str(iface.ip + 1)
        try:
            envs = httpx.get(f"http://{candidate}:{ENVD_PORT}/envs", headers=headers, timeout=1)
        except httpx.HTTPError:
            continue
        if envs.is_success and envs.json().get("E2B_SANDBOX_ID") == sbx.sandbox_id:
            return candidate
    raise RuntimeError(f"no slot address answers for {sbx.sandbox_id}")


def direct_sandbox(sbx: Any, address: str) -> Any:
    """The same sandbox, but the SDK talks to its envd at the slot address, not the proxy."""
    from e2b import ConnectionConfig, Sandbox

    # The headers the SDK sends after a create (routing and the envd token); envd ignores the
    # routing ones, so both paths carry the same bytes.
    headers = {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "E2b-Sandbox-Port": str(ENVD_PORT),
        "X-Access-Token": sbx._envd_access_token,
    }
    config = ConnectionConfig(
        api_url=BASE,
        sandbox_url=f"http://{address}:{ENVD_PORT}",
        api_key=os.environ["E2B_API_KEY"],
        debug=False,
        extra_sandbox_headers=headers,
    )
    return Sandbox(
        sandbox_id=sbx.sandbox_id,
        sandbox_domain=None,
        envd_version=sbx._envd_version,
        envd_access_token=sbx._envd_access_token,
        traffic_access_token=None,
        connection_config=config,
    )


def bench_proxy() -> dict[str, Any]:
    from e2b import Sandbox

    from tests.support.http_wait import wait_until_up

    log(f"proxy overhead: commands.run('true') x{PROXY_RUNS} each way...")
    sbx = Sandbox.create(timeout=900)
    try:
        address = guest_address(sbx)
        direct = direct_sandbox(sbx, address)
        samples: dict[str, list[float]] = {"direct": [], "proxy": []}
        for sandbox in (direct, sbx):  # warm-up: connections, the guest's page cache
            for _ in range(3):
                sandbox.commands.run("true")
        for _ in range(PROXY_RUNS):
            for name, sandbox in (("direct", direct), ("proxy", sbx)):
                samples[name].append(timed(functools.partial(sandbox.commands.run, "true"))[0])
        d50, p50 = statistics.median(samples["direct"]), statistics.median(samples["proxy"])
        d99, p99 = percentile(samples["direct"], 99), percentile(samples["proxy"], 99)
        commands = {
            "runs": PROXY_RUNS,
            "direct_ms": summary_ms(samples["direct"]),
            "proxy_ms": summary_ms(samples["proxy"]),
            "overhead_p50_ms": round((p50 - d50) * 1000, 3),
            "ratio_p50": round(p50 / d50, 3),
            "ratio_p99": round(p99 / d99, 3),
        }
        log(f"  ratio p50 {commands['ratio_p50']}; HTTP to a web server in the sandbox...")
        sbx.files.write("/tmp/web.py", WEB_SERVER)
        sbx.commands.run("python3 /tmp/web.py", background=True)
        if not wait_until_up(f"http://{address}:{WEB_PORT}/", 60, interval_s=0.2):
            raise RuntimeError("the web server in the sandbox did not start")
        route = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(WEB_PORT)}
        rates: dict[str, list[float]] = {"direct": [], "proxy": []}
        for _ in range(2):  # alternating; best of two each
            direct = http_rate(address, WEB_PORT, {}, HTTP_REQUESTS, HTTP_CONCURRENCY)
            rates["direct"].append(asyncio.run(direct))
            proxied = http_rate("127.0.0.1", 3000, route, HTTP_REQUESTS, HTTP_CONCURRENCY)
            rates["proxy"].append(asyncio.run(proxied))
        http = {
            "requests": HTTP_REQUESTS,
            "concurrency": HTTP_CONCURRENCY,
            "direct_rps": [round(r) for r in rates["direct"]],
            "proxy_rps": [round(r) for r in rates["proxy"]],
            "ratio_best": round(max(rates["direct"]) / max(rates["proxy"]), 3),
        }
        log(f"  direct {http['direct_rps']} req/s, proxy {http['proxy_rps']} req/s")
    finally:
        sbx.kill()
    return {"commands_run_true": commands, "http_small_requests": http}


# -- sustained creates -------------------------------------------------------------------------


def bench_sustained() -> dict[str, Any]:
    from e2b import Sandbox

    log(f"sustained create + kill: {SUSTAIN_WORKERS} workers for {SUSTAIN_S:.0f} s...")
    creates: list[float] = []
    kills: list[float] = []
    failures: list[str] = []
    start = time.perf_counter()
    deadline = start + SUSTAIN_S

    def worker() -> None:
        while time.perf_counter() < deadline:
            try:
                took, sbx = timed(lambda: Sandbox.create(timeout=300))
            except Exception as e:
                failures.append(repr(e)[:200])
                continue
            creates.append(took)
            kills.append(timed(sbx.kill)[0])

    threads = [threading.Thread(target=worker) for _ in range(SUSTAIN_WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    rate = len(creates) / elapsed
    log(f"  {len(creates)} creates in {elapsed:.1f} s: {rate:.2f}/s")
    return {
        "workers": SUSTAIN_WORKERS,
        "duration_s": round(elapsed, 1),
        "creates": len(creates),
        "creates_per_s": round(rate, 2),
        "create_ms": summary_ms(creates) if creates else None,
        "kill_ms": summary_ms(kills) if kills else None,
        "failures": failures[:5],
        "failure_count": len(failures),
    }


# -- CPU per create ----------------------------------------------------------------------------


def _server_process() -> Any:
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "aenv.cli" in cmdline and "server" in cmdline:
            return proc
    raise RuntimeError("the aenv server process was not found")


def bench_cpu_per_create() -> dict[str, Any]:
    """CPU one create + kill costs the whole machine, and how much of it is the server process
    itself (API, catalog, proxy, orchestration) vs its children (the VMMs, the guests under
    TCG, helpers), measured over sequential cycles: what bounds the sustained rate."""
    import psutil
    from e2b import Sandbox

    log(f"CPU per create + kill: {CPU_CYCLES} sequential cycles...")
    server = _server_process()

    def sample() -> tuple[float, float, float, float]:
        machine = psutil.cpu_times()
        own = server.cpu_times()
        return (
            time.perf_counter(),
            machine.user + machine.system + machine.nice + machine.irq + machine.softirq,
            own.user + own.system,
            own.children_user + own.children_system,
        )

    for _ in range(3):  # warm
        Sandbox.create(timeout=120).kill()
    before = sample()
    for _ in range(CPU_CYCLES):
        Sandbox.create(timeout=120).kill()
    after = sample()
    wall, machine, own, children = (
        round((b - a) / CPU_CYCLES * 1000, 1) for a, b in zip(before, after, strict=True)
    )
    log(f"  {machine} ms of CPU per cycle: server {own} ms, its children {children} ms")
    cores = os.cpu_count() or 1
    return {
        "cycles": CPU_CYCLES,
        "wall_ms_per_cycle": wall,
        "machine_cpu_ms_per_cycle": machine,
        "server_process_cpu_ms": own,
        "children_cpu_ms": children,
        "cores": cores,
        "max_creates_per_s_cpu_bound": round(cores / (machine / 1000), 1),
        "max_creates_per_s_server_only": round(cores / (own / 1000), 1),
    }


# -- list with many sandboxes ------------------------------------------------------------------


def time_list(expected: int) -> dict[str, Any]:
    import httpx
    from e2b import Sandbox

    headers = {"X-API-Key": os.environ["E2B_API_KEY"]}
    first: list[float] = []
    every: list[float] = []
    sdk: list[float] = []
    with httpx.Client(base_url=BASE, headers=headers, timeout=60) as client:

        def all_pages() -> int:
            seen, token = 0, None
            while True:
                params = {"limit": 100, **({"nextToken": token} if token else {})}
                response = client.get("/v2/sandboxes", params=params)
                response.raise_for_status()
                seen += len(response.json())
                token = response.headers.get("x-next-token")
                if not token:
                    return seen

        def sdk_pages() -> int:
            paginator, seen = Sandbox.list(limit=100), 0
            while paginator.has_next:
                seen += len(paginator.next_items())
            return seen

        for _ in range(2):  # warm-up
            all_pages()
        for _ in range(LIST_REPS):
            first.append(timed(lambda: client.get("/v2/sandboxes", params={"limit": 100}))[0])
            took, seen = timed(all_pages)
            assert seen == expected, (seen, expected)
            every.append(took)
            took, seen = timed(sdk_pages)
            assert seen == expected, (seen, expected)
            sdk.append(took)
    return {
        "sandboxes": expected,
        "first_page_ms": summary_ms(first),
        "all_pages_ms": summary_ms(every),
        "all_pages_sdk_ms": summary_ms(sdk),
    }


def bench_list() -> dict[str, Any]:
    import httpx
    from e2b import Sandbox

    home = Path(os.environ["AENV_HOME"])
    ids: list[str] = []
    cycles: list[tuple[float, float]] = []  # (create, pause) seconds
    lock = threading.Lock()

    def stored_mib() -> float:
        """What paused sandboxes hold on disk: their directories and the repository."""
        paths = Paths(home)
        return sum(dir_size(d)["allocated_mib"] for d in (paths.sandboxes, paths.repository))

    def pause(sbx: Any) -> None:
        if LIST_PAUSE == "memory":
            assert sbx.pause() is True
            return
        # Filesystem-only (`{"memory": false}`): a paused sandbox then holds its disk layer
        # only, so 1,000 of them fit on this disk; the listing does not care which kind.
        response = httpx.post(
            f"{BASE}/sandboxes/{sbx.sandbox_id}/pause",
            json={"memory": False},
            headers={"X-API-Key": os.environ["E2B_API_KEY"]},
            timeout=300,
        )
        assert response.status_code == 204, response.text

    def cycle() -> None:
        create_s, sbx = timed(lambda: Sandbox.create(timeout=3600))
        pause_s, _ = timed(lambda: pause(sbx))
        with lock:
            ids.append(sbx.sandbox_id)
            cycles.append((create_s, pause_s))

    # One alone first: what a create + pause costs here, and what a paused sandbox holds on
    # disk (its checkpoint, and the background copy in the snapshot repository).
    before = stored_mib()
    cycle()
    one_cycle = sum(cycles[0])
    wait_until(lambda: unarchived_pauses(home) == 0, 600)
    footprint = stored_mib() - before
    first = {
        **dir_size(Paths(home).sandboxes / ids[0]),
        "files_mib": files_mib(Paths(home).sandboxes / ids[0]),
        "with_repository_copy_mib": round(footprint, 2),
    }
    start_free = shutil.disk_usage(home).free
    disk_cap = 1 + int(start_free * 0.5 / (max(footprint, 1.0) * 2**20))
    target = min(LIST_N, disk_cap)
    log(
        f"list: one create + pause took {one_cycle:.2f} s and holds {footprint:.0f} MiB on "
        f"disk; filling to {target} paused sandboxes (asked {LIST_N}, half the free disk "
        f"allows {disk_cap}, budget {LIST_BUDGET_S:.0f} s)..."
    )
    milestones = sorted({m for m in (10, 100, 250, 500, 1000, 2000) if m < target} | {target})
    measured: list[dict[str, Any]] = []
    busy = [0]
    started = time.perf_counter()
    deadline = started + LIST_BUDGET_S

    def filler(goal: int) -> None:
        while time.perf_counter() < deadline and shutil.disk_usage(home).free > start_free / 2:
            with lock:
                if len(ids) + busy[0] >= goal:
                    return
                busy[0] += 1
            try:
                cycle()
            finally:
                with lock:
                    busy[0] -= 1

    try:
        for goal in milestones:
            threads = [threading.Thread(target=filler, args=(goal,)) for _ in range(LIST_WORKERS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            reached = len(ids)
            elapsed = time.perf_counter() - started
            # Repository copies of the pauses are still being written: let them finish, so
            # the list is timed on a node doing nothing else.
            settle = wait_until(lambda: unarchived_pauses(home) == 0, 900)
            log(f"  {reached} paused after {elapsed:.0f} s (+{settle:.0f} s of copies); list...")
            measured.append(
                {
                    **time_list(reached),
                    "filled_after_s": round(elapsed, 1),
                    "copies_settled_after_s": round(settle, 1),
                }
            )
            log(
                f"  first page {measured[-1]['first_page_ms']['median']:.1f} ms, all pages "
                f"{measured[-1]['all_pages_ms']['median']:.1f} ms (median)"
            )
            if reached < goal:
                log("  time budget or disk spent")
                break
        stored = stored_mib()
    finally:
        log(f"  killing {len(ids)} sandboxes...")
        kill_s = kill_all(ids)
        log(f"  killed in {kill_s:.1f} s")
    fill_s = measured[-1]["filled_after_s"] if measured else None
    return {
        "asked": LIST_N,
        "pause": LIST_PAUSE,
        "reached": len(ids),
        "budget_s": LIST_BUDGET_S,
        "disk_cap": disk_cap,
        "workers": LIST_WORKERS,
        "first_cycle_s": round(one_cycle, 3),
        "first_paused_sandbox_on_disk": first,
        "stored_per_sandbox_mib": round(stored / len(ids), 1),
        "create_ms": summary_ms([c[0] for c in cycles]),
        "pause_ms": summary_ms([c[1] for c in cycles]),
        "paused_per_s": round(len(ids) / fill_s, 2) if fill_s else None,
        "kill_all_s": round(kill_s, 1),
        "by_count": measured,
    }


# -- entry points ------------------------------------------------------------------------------


def client() -> None:
    """Runs inside the server's namespace."""
    from importlib.metadata import version

    from e2b import Sandbox

    client_env()
    warm, sandbox_id = timed(lambda: create_and_run()[0])
    kill_all([sandbox_id])
    log(f"server up; a first create + command took {warm:.2f} s")
    result: dict[str, Any] = {"sdk": f"e2b {version('e2b')}"}
    try:
        result["create_to_first_command"] = bench_create()
        result["proxy"] = bench_proxy()
        result["sustained_creates"] = bench_sustained()
        result["cpu_per_create"] = bench_cpu_per_create()
        result["list"] = bench_list()
    finally:
        left = [s.sandbox_id for s in Sandbox.list(limit=100).next_items()]
        while left:  # anything an error left behind
            kill_all(left)
            left = [s.sandbox_id for s in Sandbox.list(limit=100).next_items()]
    print(json.dumps(result))


def main() -> None:
    env = {"AENV_MAX_SANDBOXES": str(max(LIST_N, BURST) + 64)}
    with bench_server(env) as server:
        result = run_client(server, [sys.executable, __file__, "--client"], timeout=5400)
        machine = describe(server)
    report("server", **machine, **result)


if __name__ == "__main__":
    entry(main, client)
