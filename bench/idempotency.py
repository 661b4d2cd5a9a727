"""Create with an `Idempotency-Key` against create without one, in one run: the control plane
over a node on doubles (tests/doubles, no VMs), reached in-process, so what is timed is the API
and orchestrator path the key adds to (a real create adds a VM restore of ~250 ms under TCG,
making the key's share smaller still). Also a retry answered from the key (no create at all).
Each sandbox is killed after its create is timed. Prints JSON."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from summary import summary_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aenv.api.app import create_api
from aenv.api.keys import KeyStore
from tests.doubles.node import double_node

KEY = "e2b_" + "cd" * 20
ROUNDS = 200
BODY = {"templateID": "base"}


async def _timed(api: httpx.AsyncClient, headers: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    response = await api.post("/v2/sandboxes", json=BODY, headers=headers)
    elapsed = time.perf_counter() - start
    assert response.status_code == 201, response.text
    return elapsed, str(response.json()["sandboxID"])


async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="aenv-bench-idem-") as tmp:
        async with double_node(Path(tmp)) as node:
            keys = KeyStore(Path(tmp) / "keys.json")
            keys.add(KEY, "bench")
            app = create_api(node.orchestrator, node.config, keys)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://node", headers={"X-API-Key": KEY}
            ) as api:
                plain, keyed, retried = [], [], []
                for i in range(ROUNDS):  # interleaved: both see the same machine load
                    elapsed, sandbox = await _timed(api, {})
                    plain.append(elapsed)
                    await node.orchestrator.kill(sandbox)
                    headers = {"Idempotency-Key": f"bench-{i}"}
                    elapsed, sandbox = await _timed(api, headers)
                    keyed.append(elapsed)
                    elapsed, again = await _timed(api, headers)
                    assert again == sandbox
                    retried.append(elapsed)
                    await node.orchestrator.kill(sandbox)
    print(
        json.dumps(
            {
                "create_without_key_ms": summary_ms(plain),
                "create_with_key_ms": summary_ms(keyed),
                "retry_answered_by_key_ms": summary_ms(retried),
                "with_key_over_without_median": round(
                    statistics.median(keyed) / statistics.median(plain), 3
                ),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
