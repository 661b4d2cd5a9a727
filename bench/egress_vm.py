"""Egress rules with a real VM: the unmodified SDK against a real `aenv server`
(bench/server_ns.py) with the tests' simulated internet behind it (tests/e2e/internet.py).

- a 256 MiB download by curl in the sandbox from the internet's web server, with no rules and
  with domain rules (every connection through the slot's domain proxy), in the same run;
- connection setup to first byte of a small response, both ways (interleaved);
- `update_network` p50/p99, alternating address rules and domain rules (every second call
  starts the slot's domain proxy and DNS forwarder, every other one stops them), beside
  `set_timeout` on the same sandbox (a small control-plane call with no slot work) interleaved.

Prints one JSON document.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from e2b import Sandbox

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server_ns import bench_server, client_env, describe, entry, report, run_client
from summary import summary_ms

RUNS = 100
SETUPS = 50
DOWNLOADS = 3
FILE_BYTES = 256 * 2**20


def _curl(sandbox: Sandbox, url: str, fmt: str) -> float:
    run = f"curl -s -o /dev/null -H 'Host: allowed.test' -w '{fmt}' {url}"
    return float(sandbox.commands.run(run, timeout=600).stdout)


def client() -> None:
    """Runs inside the server's namespace."""
    from e2b import Sandbox
    from e2b.sandbox.sandbox_api import SandboxNetworkUpdate

    from tests.e2e.internet import PUBLIC

    address = PUBLIC[0]
    none: SandboxNetworkUpdate = {}
    addresses: SandboxNetworkUpdate = {"allow_out": [address], "deny_out": ["0.0.0.0/0"]}
    domains: SandboxNetworkUpdate = {"allow_out": ["allowed.test"], "deny_out": ["0.0.0.0/0"]}
    client_env()
    sandbox = Sandbox.create(timeout=1800)
    result: dict[str, object] = {"file_mib": FILE_BYTES // 2**20}
    try:
        speeds: dict[str, list[float]] = {"none": [], "domain_rules": []}
        setups: dict[str, list[float]] = {"none": [], "domain_rules": []}
        for _ in range(DOWNLOADS):  # interleaved, so drift hits both alike
            for name, rules in (("none", none), ("domain_rules", domains)):
                sandbox.update_network(rules)
                big = f"http://{address}/bytes/{FILE_BYTES}"
                speeds[name].append(_curl(sandbox, big, "%{speed_download}"))
        for _ in range(SETUPS):  # interleaved too
            for name, rules in (("none", none), ("domain_rules", domains)):
                sandbox.update_network(rules)
                setups[name].append(_curl(sandbox, f"http://{address}/", "%{time_starttransfer}"))
        best = {name: max(samples) for name, samples in speeds.items()}
        result.update(
            {
                "download_none_mib_s": round(best["none"] / 2**20, 1),
                "download_domain_rules_mib_s": round(best["domain_rules"] / 2**20, 1),
                "download_ratio": round(best["domain_rules"] / best["none"], 3),
                "setup_none_ms": summary_ms(setups["none"]),
                "setup_domain_rules_ms": summary_ms(setups["domain_rules"]),
                "setup_overhead_median_ms": round(
                    (statistics.median(setups["domain_rules"]) - statistics.median(setups["none"]))
                    * 1000,
                    2,
                ),
            }
        )
        updates: list[float] = []
        timeouts: list[float] = []
        for i in range(RUNS):
            start = time.perf_counter()
            sandbox.update_network(domains if i % 2 else addresses)
            updates.append(time.perf_counter() - start)
            start = time.perf_counter()
            sandbox.set_timeout(1800)
            timeouts.append(time.perf_counter() - start)
        result["update_network_ms"] = summary_ms(updates)
        result["set_timeout_ms"] = summary_ms(timeouts)
    finally:
        sandbox.kill()
    print(json.dumps(result))


def main() -> None:
    from tests.e2e.internet import Certificates, simulated_internet

    with tempfile.TemporaryDirectory() as scratch, bench_server() as server:
        with simulated_internet(server.netns, Certificates.make(Path(scratch))):
            result = run_client(server, [sys.executable, __file__, "--client"], timeout=3600)
        machine = describe(server)
    report("egress_vm", **machine, **result)


if __name__ == "__main__":
    entry(main, client)
