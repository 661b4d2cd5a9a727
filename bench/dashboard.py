"""`python bench/dashboard.py [COUNT]`: the dashboard's sandbox list with COUNT sandboxes (1000 by
default) on a node of doubles (tests/doubles: the real catalog, orchestrator and API, no VMs),
served on loopback, read by a signed-in client. The sandboxes are rows written straight into
the catalog, which is all the list reads. Prints JSON.

- first render: `GET /dashboard/sandboxes` (a page of 50, rendered on the server): the node's
  very first (cold), then p50/p99,
  over the API's own page (`GET /v2/sandboxes?limit=50`) in the same run (the dashboard reads
  that page, then renders it): the cost of the rendering;
- a look of the live list (one server-sent event of the same rows) likewise;
- the first render in a real browser (Debian's headless Chromium through Playwright, as
  tests/dashboard drive it): from `page.goto` to the page's 50 rows in the DOM, and the
  browser's own first contentful paint and DOMContentLoaded (Navigation and Paint Timing),
  the browser's first page (cold: fresh profile, nothing cached) apart from the next ones.

Target (issue 32): the first render within 1 s with 1,000 sandboxes.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tests/

from aenv.api.app import create_api
from aenv.api.keys import KeyStore
from aenv.dashboard.app import Dashboard
from aenv.network.settings import SandboxNetwork
from aenv.orchestrator.catalog import SandboxRecord
from aenv.orchestrator.kinds import SaveMode
from aenv.orchestrator.states import SandboxState
from tests.dashboard.browser import chromium, new_page
from tests.doubles.node import double_node
from tests.support.loopback_api import served

KEY = "e2b_" + "5" * 40
ROUNDS = 30
# The browser's own timings of the page it shows, in ms from the navigation's start.
_TIMINGS = """() => {
  const nav = performance.getEntriesByType("navigation")[0];
  const paint = performance.getEntriesByName("first-contentful-paint")[0];
  return {dcl: nav.domContentLoadedEventEnd, fcp: paint ? paint.startTime : null};
}"""


async def _timed(client: httpx.AsyncClient, path: str, **headers: str) -> float:
    start = time.perf_counter()
    answer = await client.get(path, headers=headers)
    elapsed = time.perf_counter() - start
    assert answer.status_code == 200, answer.text
    return elapsed


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 2),
    }


async def _in_browser(url: str) -> dict[str, object]:
    """The list's first render in Chromium: its cold first page, then `ROUNDS` more."""
    async with chromium() as browser, new_page(browser) as page:
        await page.goto(f"{url}/dashboard/sign-in")
        await page.fill("#key", KEY)
        rows = page.locator("tr[data-sandbox]")
        start = time.perf_counter()
        await page.click(".sign-in button")  # answered by the list's first page
        await rows.nth(49).wait_for(state="attached")
        cold = time.perf_counter() - start
        cold_timings = await page.evaluate(_TIMINGS)
        shown, dcl, fcp = [], [], []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            await page.goto(f"{url}/dashboard/sandboxes", wait_until="commit")
            await rows.nth(49).wait_for(state="attached")
            shown.append(time.perf_counter() - start)
            timings = await page.evaluate(_TIMINGS)
            dcl.append(timings["dcl"] / 1000)
            if timings["fcp"] is not None:
                fcp.append(timings["fcp"] / 1000)
    return {
        "cold_rows_shown_ms": round(cold * 1000, 2),
        "cold_first_contentful_paint_ms": cold_timings["fcp"],
        "rows_shown": _stats(shown),
        "dom_content_loaded": _stats(dcl),
        "first_contentful_paint": _stats(fcp) if fcp else None,
    }


async def main(count: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="aenv-bench-dashboard-") as scratch:
        home = Path(scratch)
        async with double_node(home) as node:
            keys = KeyStore(home / "api-keys.json")
            keys.add(KEY, "bench")
            now = time.time()
            for n in range(count):
                node.catalog.insert(
                    SandboxRecord(
                        id=f"bench{n:015d}", template_id="base", state=SandboxState.RUNNING,
                        cpu_count=1, memory_mb=512, disk_size_mb=1024, started_at=now - n,
                        end_at=now + 3600, metadata={"n": str(n)}, env_vars={},
                        envd_access_token="token", restored_from="/t/base", timeout=3600,
                        auto_pause_mode=SaveMode.FULL, network=SandboxNetwork(),
                    )
                )  # fmt: skip
            api = create_api(node.orchestrator, node.config, keys)
            dashboard = Dashboard(api, live_interval=0.01, stream_s=0.0)
            async with served(dashboard) as url, httpx.AsyncClient(base_url=url) as client:
                origin = {"Origin": url, "Sec-Fetch-Site": "same-origin"}
                signed_in = await client.post(
                    "/dashboard/sign-in", data={"key": KEY}, headers=origin
                )
                assert signed_in.status_code == 303
                # The node's first page after its start: templates compiled, caches cold.
                cold = await _timed(client, "/dashboard/sandboxes")
                page, api_page, live = [], [], []
                for _ in range(ROUNDS):  # interleaved: the same load for each
                    page.append(await _timed(client, "/dashboard/sandboxes"))
                    api_page.append(
                        await _timed(client, "/v2/sandboxes?limit=50", **{"X-API-KEY": KEY})
                    )
                    live.append(await _timed(client, "/dashboard/sandboxes/live"))
                shown = await _in_browser(url)
    first = _stats(page)
    baseline = _stats(api_page)
    return {
        "sandboxes": count,
        "rounds": ROUNDS,
        "cold_first_render_ms": round(cold * 1000, 2),
        "dashboard_first_render": first,
        "api_page": baseline,
        "live_look": _stats(live),
        "render_over_api_p50": round(first["p50_ms"] / baseline["p50_ms"], 2),
        "browser": shown,
        "target_first_render_ms": 1000,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000)), indent=2))
