"""`python bench/events.py`: what lifecycle events and webhooks cost a create, and how soon a
local receiver gets an event. The control plane over a node on doubles (tests/doubles, no VMs),
reached in-process, so what is timed is the API and orchestrator path events add to (a real
create adds a VM restore of ~250 ms under TCG, making their share smaller still). Prints JSON.

Three modes, interleaved round by round so that all see the same machine load:
- `off`: the node's `EventLog.record` swapped for a no-op (no row, no queue);
- `events`: events written, no webhook;
- `webhook`: events written and queued for one enabled webhook, delivered to a receiver on
  loopback (uvicorn in the same event loop, as a node delivers from its own).
Each round creates (`POST /v2/sandboxes`, timed) and kills one sandbox per mode. Delivery
latency: from `EventLog.record` writing the event to the receiver reading its body, for the
created and killed events of the `webhook` rounds; each round waits for both before the next,
so no delivery queues behind another round's.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from summary import summary_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aenv.api.app import create_api
from aenv.api.keys import KeyStore
from aenv.orchestrator.events import EventLog, SandboxEvent
from tests.doubles.node import double_node
from tests.support import loopback_api

KEY = "e2b_" + "ef" * 20
ROUNDS = 200
BODY = {"templateID": "base"}
EVENTS = ["sandbox.lifecycle.created", "sandbox.lifecycle.killed"]


def _stamping(record: Callable[..., SandboxEvent | None], written: dict[str, float]) -> Any:
    """`record`, noting when each event was written."""

    def stamped(*args: Any, **kwargs: Any) -> SandboxEvent | None:
        event = record(*args, **kwargs)
        if event is not None:
            written[event.id] = time.perf_counter()
        return event

    return stamped


async def main() -> None:
    received: dict[str, float] = {}

    async def hook(request: Request) -> Response:
        body = json.loads(await request.body())
        received[body["id"]] = time.perf_counter()
        return Response(status_code=204)

    receiver = Starlette(routes=[Route("/hook", hook, methods=["POST"])])
    settings: dict[str, Any] = {"webhook_internal_allowed": True}
    with tempfile.TemporaryDirectory(prefix="aenv-bench-events-") as tmp:
        async with (
            loopback_api.served(receiver) as url,
            double_node(Path(tmp), **settings) as node,
        ):
            keys = KeyStore(Path(tmp) / "keys.json")
            keys.add(KEY, "bench")
            app = create_api(node.orchestrator, node.config, keys)
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app),
                base_url="http://node",
                headers={"X-API-Key": KEY},
            ) as api:
                registered = await api.post(
                    "/events/webhooks",
                    json={
                        "name": "bench",
                        "url": f"{url}/hook",
                        "events": EVENTS,
                        "signatureSecret": "bench",
                        "enabled": False,
                    },
                )
                assert registered.status_code == 201, registered.text
                webhook = f"/events/webhooks/{registered.json()['id']}"
                log: EventLog = node.orchestrator.events
                written: dict[str, float] = {}
                real = log.record
                modes: dict[str, Callable[..., SandboxEvent | None]] = {
                    "off": lambda *args, **kwargs: None,
                    "events": _stamping(real, written),
                    "webhook": _stamping(real, written),
                }
                times: dict[str, list[float]] = {mode: [] for mode in modes}
                latencies: list[float] = []
                for _ in range(ROUNDS):
                    for mode, record in modes.items():
                        enabled = await api.patch(webhook, json={"enabled": mode == "webhook"})
                        assert enabled.status_code == 200
                        log.record = record  # type: ignore[method-assign]
                        written.clear()
                        start = time.perf_counter()
                        created = await api.post("/v2/sandboxes", json=BODY)
                        times[mode].append(time.perf_counter() - start)
                        assert created.status_code == 201, created.text
                        await node.orchestrator.kill(created.json()["sandboxID"])
                        if mode == "webhook":
                            while not all(e in received for e in written):
                                await asyncio.sleep(0.001)
                            latencies += [received[e] - t for e, t in written.items()]
                log.record = real  # type: ignore[method-assign]
    medians = {mode: statistics.median(samples) for mode, samples in times.items()}
    print(
        json.dumps(
            {
                "rounds": ROUNDS,
                "create_ms": {mode: summary_ms(samples) for mode, samples in times.items()},
                "events_over_off_median": round(medians["events"] / medians["off"], 3),
                "webhook_over_off_median": round(medians["webhook"] / medians["off"], 3),
                "delivery_latency_ms": summary_ms(latencies),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
