"""What the metrics history's sampling costs the server: CPU time of one sampling round over
100 running sandboxes (a request to each one's envd and the bookkeeping), against one round
over a single sandbox in the same run. On a node on doubles: each guest's envd is an in-process
double answering a fixed sample, so its side of the exchange is counted too (an upper bound of
the server's own share). Prints JSON."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from summary import summary_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aenv.orchestrator.metrics_history import INTERVAL
from tests.doubles.node import double_node

SANDBOXES = 100
ROUNDS = 20


async def _rounds(sample: Callable[[], Awaitable[None]]) -> list[float]:
    times = []
    for _ in range(ROUNDS):
        start = time.process_time()
        await sample()
        times.append(time.process_time() - start)
    return times


async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="aenv-bench-metrics-") as tmp:
        async with double_node(Path(tmp)) as node:
            orc = node.orchestrator
            first, _ = await orc.create(node.request())
            single = await _rounds(orc.sample_metrics)
            for _ in range(SANDBOXES - 1):
                await orc.create(node.request())
            hundred = await _rounds(orc.sample_metrics)
            assert orc.metrics.latest(first.id) is not None
    per_round = sorted(hundred)[len(hundred) // 2]
    print(
        json.dumps(
            {
                "round_cpu_1_sandbox_ms": summary_ms(single),
                "round_cpu_100_sandboxes_ms": summary_ms(hundred),
                "interval_s": INTERVAL,
                "cores_per_100_sandboxes": round(per_round / INTERVAL, 4),
                "ratio_100_over_1": round(per_round / sorted(single)[len(single) // 2], 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
