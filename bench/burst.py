"""`python bench/burst.py [COUNT]`: a burst of COUNT (500) creates at once through one gateway,
past what the cluster holds, asking to wait for room (`X-Aenv-Wait`, issue 35). Prints JSON.

Two real nodes (each in its own network namespace, `max_sandboxes` = AENV_BENCH_NODE_MAX, 16)
behind one real gateway on a real Redis, the official e2b SDK in the gateway's namespace
(tests/cluster/sdk/burst.py): two API keys send 3/4 and 1/4 of the creates, all threads started
together (the larger key's first), each create followed by one command and a kill as soon as
it answers. The SDK's own retries are off, so no client-side retry or jitter hides a refusal;
its connection pool holds more than the burst (`E2B_MAX_CONNECTIONS`: a waiting create holds a
connection, and at the default 200 the kills that make room would wait behind the creates).

- baseline, in the same run: the same burst without the header: how many are refused (429);
- the burst that waits: started and failed per key, the seconds from the first create to the
  last answer and creates per second, what `GET /aenv/queue` showed while it ran (most
  waiting, each key's furthest place, creates waiting at the gateway for a slot of their key's
  limit), and fairness: each key's share of every tenth of the answers in order, and the rank
  of each key's last answer (served in the order sent, the smaller key's would all come last).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from cluster import OnCluster, on_cluster

ROOT = Path(__file__).resolve().parents[1]
CLIENT = str(ROOT / "tests" / "cluster" / "sdk" / "burst.py")
NODE_MAX = int(os.environ.get("AENV_BENCH_NODE_MAX", "16"))
WAIT_S = 3600


def make_key(on: OnCluster, name: str) -> str:
    """A second API key, made through the gateway."""
    gateway = on.nodes.gateway
    out = on.run(
        "curl", "-sf", "-X", "POST", "-H", f"X-API-Key: {gateway.api_key}",
        "-H", "Content-Type: application/json", "-d", json.dumps({"name": name}),
        f"{gateway.url}/api-keys",
    )  # fmt: skip
    key: str = json.loads(out)["key"]
    return key


def shares(order: str, labels: list[str], parts: int = 10) -> dict[str, list[float]]:
    """Each label's share of every `parts`-th of `order` (the answers' labels in turn)."""
    size = max(1, len(order) // parts)
    cuts = [order[i : i + size] for i in range(0, len(order), size)]
    return {label: [round(c.count(label) / len(c), 2) for c in cuts] for label in labels}


async def burst(scratch: Path, count: int) -> dict[str, Any]:
    settings = {"AENV_MAX_SANDBOXES": str(NODE_MAX), "AENV_CREATE_MAX_WAIT": str(WAIT_S)}
    async with on_cluster(scratch, ["node-a", "node-b"], settings) as on:
        big = count * 3 // 4
        keys = [f"a={on.env['E2B_API_KEY']}:{big}", f"b={make_key(on, 'burst')}:{count - big}"]

        def once(wait: float) -> dict[str, Any]:
            # Every waiting create holds one of the SDK's connections to the gateway (HTTP/1,
            # 200 per address by default): the kills that make room need more than the burst.
            pool = {**on.env, "E2B_MAX_CONNECTIONS": str(count + 64)}
            argv = [sys.executable, CLIENT, str(wait), *keys]
            code, out = on.nodes.gateway.run(argv, env=pool, timeout=3600)
            if code != 0:
                raise RuntimeError(out[-5000:])
            # Its stdout comes before its stderr (a warning, say): the JSON line is the last
            # one that starts as one.
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if not lines:
                raise RuntimeError(f"the burst's client printed no result:\n{out[-5000:]}")
            result: dict[str, Any] = json.loads(lines[-1])
            return result

        refused = once(0)
        waited = once(WAIT_S)
        left = {node: sorted(await on.routes.of_node(node)) for node in ("node-a", "node-b")}
    started = sum(k["started"] for k in waited["keys"].values())
    failures: collections.Counter[str] = collections.Counter()
    for key in refused["keys"].values():
        failures.update(key["failed"])
    order = waited.pop("order")
    return {
        "count": count,
        "nodes": 2,
        "node_max_sandboxes": NODE_MAX,
        "without_wait": {
            "started": sum(k["started"] for k in refused["keys"].values()),
            "refused": sum(sum(k["failed"].values()) for k in refused["keys"].values()),
            "failures": failures,
        },
        "with_wait": {
            **waited,
            "started": started,
            "creates_per_s": round(started / waited["seconds_to_last"], 3),
            "share_by_tenth": shares(order, ["a", "b"]),
        },
        "routes_left": left,
    }


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    scratch = Path(tempfile.mkdtemp(prefix="aenv-bench-burst-wait-"))
    try:
        print(json.dumps(asyncio.run(burst(scratch, count)), indent=2))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
