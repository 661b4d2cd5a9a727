"""One sandbox's page over HTTP: its facts, metrics, network, events and console, read through
the API, and the same kept live (server-sent events) as the sandbox changes."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.dashboard.conftest import Site, page_client
from tests.dashboard.test_sessions import sign_in


@pytest.fixture
async def browser(site: Site) -> AsyncIterator[httpx.AsyncClient]:
    async with page_client(site.dashboard) as client:
        await sign_in(client)
        yield client


async def test_a_sandboxs_page_and_its_live_panels(site: Site, browser: httpx.AsyncClient) -> None:
    sandbox_id = await site.create(owner="page-test")
    page = await browser.get(f"/dashboard/sandboxes/{sandbox_id}")
    assert page.status_code == 200
    assert "owner=page-test" in page.text
    assert "sandbox.lifecycle.created" in page.text
    # The charts' columns (uPlot's data, drawn in the browser) are the API's samples.
    times = chart_series(page.text, "cpu")[0]
    assert times  # sampled when the page asked
    # Up to the page's newest (whole seconds): a later call may have sampled the sandbox again.
    end = times[-1] + 1
    answer = await site.api.get(f"/sandboxes/{sandbox_id}/metrics", params={"end": end})
    samples = answer.json()
    assert [s["timestampUnix"] for s in samples] == times
    assert chart_series(page.text, "cpu") == [times, [s["cpuUsedPct"] for s in samples]]
    mib = 1 << 20
    assert chart_series(page.text, "memory") == [
        times,
        [round(s["memUsed"] / mib, 1) for s in samples],
        [round(s["memTotal"] / mib, 1) for s in samples],
    ]
    assert "Internet access" in page.text
    # No terminal without a way to reach the guest's envd (the doubles' node gives none).
    assert 'id="terminal"' not in page.text
    assert (await site.api.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
    live = await browser.get(f"/dashboard/sandboxes/{sandbox_id}/live")
    assert "state-paused" in live.text
    assert "sandbox.lifecycle.paused" in live.text
    assert (await browser.get("/dashboard/sandboxes/nosuchsandbox")).status_code == 404


def chart_series(html: str, metric: str) -> Any:
    """The columns a chart of the sandbox page is given (its figure's `data-series`)."""
    found = re.search(f"data-metric=\"{metric}\" data-series='([^']*)'", html)
    assert found is not None, f"no {metric} chart"
    return json.loads(found.group(1))


async def test_the_list_shows_running_sandboxes_usage(
    site: Site, browser: httpx.AsyncClient
) -> None:
    running = await site.create()
    paused = await site.create()
    assert (await site.api.post(f"/sandboxes/{paused}/pause")).status_code == 204
    listed = (await browser.get("/dashboard/sandboxes")).text
    row = listed.split(f'data-sandbox="{running}"', 1)[1].split("</tr>", 1)[0]
    assert 'data-metric="cpu"' in row and 'data-metric="memory"' in row
    assert "MiB" in row.split('data-metric="memory"', 1)[1]  # its current memory, and total
    paused_row = listed.split(f'data-sandbox="{paused}"', 1)[1].split("</tr>", 1)[0]
    assert "data-metric" not in paused_row  # a paused sandbox has no current sample
