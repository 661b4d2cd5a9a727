"""`update_network` end to end: the unmodified SDK against a real `aenv server` with a real VM
(bench/server_ns.py), p50/p99, beside `set_timeout` (another small control-plane call on the
same sandbox, no slot work) measured interleaved in the same run.

Updates alternate between address rules and domain rules, so every second one starts the slot's
domain proxy and DNS forwarder and every other one stops them. Prints one JSON document.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server_ns import bench_server, client_env, describe, run_client
from summary import summary_ms

RUNS = 100


def client() -> None:
    """Runs inside the server's namespace."""
    from e2b import Sandbox
    from e2b.sandbox.sandbox_api import SandboxNetworkUpdate

    addresses: SandboxNetworkUpdate = {"allow_out": ["198.51.100.10"], "deny_out": ["0.0.0.0/0"]}
    domains: SandboxNetworkUpdate = {"allow_out": ["*.example.com"], "deny_out": ["0.0.0.0/0"]}
    client_env()
    sandbox = Sandbox.create(timeout=600)
    updates: list[float] = []
    timeouts: list[float] = []
    try:
        for i in range(RUNS):
            start = time.perf_counter()
            sandbox.update_network(domains if i % 2 else addresses)
            updates.append(time.perf_counter() - start)
            start = time.perf_counter()
            sandbox.set_timeout(600)
            timeouts.append(time.perf_counter() - start)
    finally:
        sandbox.kill()
    print(
        json.dumps(
            {
                "runs": RUNS,
                "update_network_ms": summary_ms(updates),
                "set_timeout_ms": summary_ms(timeouts),
            }
        )
    )


def main() -> None:
    with bench_server() as server:
        result = run_client(server, [sys.executable, __file__, "--client"], timeout=1800)
        machine = describe(server)
    doc = {"benchmark": "update_network", "date": time.strftime("%Y-%m-%d"), **machine, **result}
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        client()
    else:
        main()
