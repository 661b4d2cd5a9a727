"""The dashboard in a real headless Chromium, over a node on doubles served on loopback: sign
in, a sandbox appearing live, killing it from the page, a wrong key, a cross-site form."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from playwright.async_api import Browser, Page, expect
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from aenv.network.settings import SandboxNetwork
from aenv.orchestrator.catalog import SandboxRecord
from aenv.orchestrator.kinds import SaveMode
from aenv.orchestrator.states import SandboxState
from tests.dashboard.browser import chromium, new_page, screenshot
from tests.dashboard.conftest import KEY, Site
from tests.support.loopback_api import served
from tests.support.wait import eventually


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with chromium() as browser:
        yield browser


@pytest.fixture
async def url(site: Site) -> AsyncIterator[str]:
    async with served(site.dashboard) as base:
        yield base


@pytest.fixture
async def page(browser: Browser) -> AsyncIterator[Page]:
    async with new_page(browser) as page:
        yield page


async def sign_in(page: Page, url: str, key: str = KEY) -> None:
    await page.goto(f"{url}/dashboard")
    await page.fill("#key", key)
    await page.click(".sign-in button")


async def test_sign_in_see_a_sandbox_appear_and_kill_it(
    site: Site, url: str, page: Page, tmp_path: Path
) -> None:
    await page.goto(f"{url}/dashboard/sign-in")
    await screenshot(page, "sign-in", tmp_path)
    await sign_in(page, url)
    await expect(page).to_have_url(f"{url}/dashboard/sandboxes")
    await expect(page.locator("tr.empty")).to_be_visible()
    # Created through the API after the page was shown: the live list brings it.
    sandbox_id = await site.create(owner="dashboard-test")
    row = page.locator(f'tr[data-sandbox="{sandbox_id}"]')
    await expect(row).to_be_visible()
    await expect(row.locator(".state")).to_have_text("running")
    await screenshot(page, "sandboxes", tmp_path)
    await row.locator("button", has_text="Kill").click()
    await expect(row).to_have_count(0)
    assert (await site.api.get(f"/sandboxes/{sandbox_id}")).status_code == 404


async def test_a_wrong_key_is_refused(url: str, page: Page) -> None:
    await sign_in(page, url, "e2b_" + "0" * 40)
    await expect(page.locator(".error")).to_have_text("Invalid API key.")
    await page.goto(f"{url}/dashboard/sandboxes")
    await expect(page).to_have_url(f"{url}/dashboard/sign-in")


async def test_a_cross_site_form_is_refused(site: Site, url: str, page: Page) -> None:
    sandbox_id = await site.create()
    await sign_in(page, url)
    await expect(page.locator(f'tr[data-sandbox="{sandbox_id}"]')).to_be_visible()

    # Another site's page (another port: same site to a cookie, another origin) posting the
    # kill form, token and all but the session's CSRF token, which it cannot read.
    async def lure(request: Request) -> HTMLResponse:
        action = f"{url}/dashboard/sandboxes/{sandbox_id}/kill"
        return HTMLResponse(
            f'<form method="post" action="{action}"><input name="csrf" value="guess">'
            '<button type="submit">Win</button></form>'
        )

    async with served(Starlette(routes=[Route("/", lure)])) as other:
        await page.goto(other)
        async with page.expect_response(lambda r: r.url.endswith("/kill")) as answer:
            await page.click("text=Win")
        assert (await answer.value).status == 403
    assert (await site.api.get(f"/sandboxes/{sandbox_id}")).status_code == 200


async def test_follow_a_builds_log(site: Site, url: str, page: Page, tmp_path: Path) -> None:
    held = site.driver.hold("snapshot")  # the build's steps have run; its save waits
    ids = await site.build("app", [{"type": "RUN", "args": ["echo first-step"]}])
    await held.reached.wait()
    await sign_in(page, url)
    await page.click("nav >> text=Templates")
    row = page.locator(f'tr[data-template="{ids[0]}"]')
    await expect(row.locator(".status")).to_have_text("building")
    await screenshot(page, "templates", tmp_path)
    await row.locator(".status").click()
    await expect(page.locator("#build-status")).to_have_text("building")
    await expect(page.locator("#build-log")).to_contain_text("first-step")
    lines = await page.locator("#build-log li").count()
    held.release()
    # The page follows: the status turns, the log grows, without a reload.
    await expect(page.locator("#build-status")).to_have_text("ready")
    await expect(page.locator("#build-log li")).not_to_have_count(lines)
    await screenshot(page, "build", tmp_path)


async def test_a_failed_builds_reason(site: Site, url: str, page: Page, tmp_path: Path) -> None:
    ids = await site.build("broken", [{"type": "RUN", "args": ["exit 3"]}])
    await sign_in(page, url)
    await page.click("nav >> text=Templates")
    row = page.locator(f'tr[data-template="{ids[0]}"]')
    # Live: listed while it builds, then failed, without a reload.
    await expect(row.locator(".status")).to_have_text("error")
    await row.locator(".status").click()
    await expect(page.locator("#build-status")).to_have_text("error")
    await expect(page.locator("#build-reason")).to_contain_text("exit 3")  # the step
    await screenshot(page, "build-failed", tmp_path)


async def test_snapshots_volumes_and_keys(site: Site, url: str, page: Page, tmp_path: Path) -> None:
    sandbox_id = await site.create()
    taken = await site.api.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": "saved"})
    snapshot_id = taken.json()["snapshotID"]
    await sign_in(page, url)
    await page.click("nav >> text=Snapshots")
    await expect(page.locator(f'tr[data-snapshot="{snapshot_id}"]')).to_be_visible()
    await screenshot(page, "snapshots", tmp_path)
    await page.click("nav >> text=Volumes")
    await page.fill("input[name=name]", "data")
    await page.click("form.inline button")
    await expect(page.locator("tr[data-volume]")).to_have_count(1)
    await screenshot(page, "volumes", tmp_path)
    # Its files, put there through the volume content API, browsed from the page.
    (volume,) = (await site.api.get("/volumes")).json()
    token = (await site.api.get(f"/volumes/{volume['volumeID']}")).json()["token"]
    put = await site.api.put(
        f"/volumecontent/{volume['volumeID']}/file",
        params={"path": "/results/run-1.csv", "force": "true"},
        headers={"Authorization": f"Bearer {token}"},
        content=b"step,loss\n1,0.9\n",
    )
    assert put.status_code == 201, put.text
    await page.click("tr[data-volume] a")
    await page.click("tr[data-file=results] a")
    await expect(page.locator("tr[data-file='run-1.csv']")).to_be_visible()
    await screenshot(page, "volume-files", tmp_path)
    await page.click("nav >> text=API keys")
    await page.fill("input[name=name]", "ci")
    await page.click("form.inline button")
    await expect(page.locator("#new-key")).to_have_text(re.compile(r"^e2b_[0-9a-f]{40}$"))
    await screenshot(page, "keys", tmp_path)
    row = page.locator("tr[data-key]", has_text="ci")
    await row.locator("button", has_text="Revoke").click()
    await expect(row).to_have_count(0)


async def test_a_sandboxs_page_follows_it(site: Site, url: str, page: Page, tmp_path: Path) -> None:
    network = {"denyOut": ["0.0.0.0/0"], "allowOut": ["10.1.2.0/24"]}
    body = {"templateID": "base", "metadata": {"owner": "page-test"}, "network": network}
    created = await site.api.post("/sandboxes", json=body)
    assert created.status_code == 201, created.text
    sandbox_id = created.json()["sandboxID"]
    await sign_in(page, url)
    await page.click(f"a[href='/dashboard/sandboxes/{sandbox_id}']")
    await expect(page.locator(".event-type").first).to_have_text("sandbox.lifecycle.created")
    # Its network rules, as the API has them.
    rules = page.locator(".facts.network")
    await expect(rules).to_contain_text('["10.1.2.0/24"]')
    await expect(rules).to_contain_text('["0.0.0.0/0"]')
    # CPU and memory over time: uPlot's canvases, drawn from every sample the API has.
    await expect(page.locator("figure.chart canvas")).to_have_count(2)
    await expect(page.locator("figure.chart .u-legend .u-label")).to_have_text(
        ["time", "CPU used", "time", "used", "total"]
    )
    await charts_hold_the_apis_samples(site, page, sandbox_id)
    # Later samples, as the node's sampler takes them (its history is what the API reads):
    # the charts follow without a reload, and draw them.
    history = site.orchestrator.metrics
    latest = history.latest(sandbox_id)
    assert latest is not None
    for n, (cpu, mib) in enumerate([(35, 180), (80, 260), (55, 240), (20, 200)], 1):
        values = latest.values | {"cpu_used_pct": cpu, "mem_used": mib << 20}
        history.add(sandbox_id, values, latest.ts + 5 * n)
    drawn = await charts_hold_the_apis_samples(site, page, sandbox_id)
    assert drawn >= 5
    assert await blue_pixels(page, "cpu") > 100  # the line and the area under it
    # The pointer on a chart: its legend says the sample's time and values, with their units.
    for metric, unit in (("cpu", "%"), ("memory", "MiB")):
        chart = page.locator(f'figure.chart[data-metric="{metric}"]')
        await chart.locator(".u-over").hover()
        legend = chart.locator(".u-legend .u-value")
        await expect(legend.first).to_have_text(re.compile(r"^\d{4}-\d\d-\d\d \d"))
        await expect(legend.nth(1)).to_have_text(re.compile(rf"^\d+(\.\d+)? {unit}$"))
    await screenshot(page, "sandbox", tmp_path)
    assert (await site.api.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
    # Without a reload: the panels follow the sandbox.
    await expect(page.locator("#sandbox-panels .state")).to_have_text("paused")
    await expect(page.locator(".event-type").first).to_have_text("sandbox.lifecycle.paused")


async def charts_hold_the_apis_samples(site: Site, page: Page, sandbox_id: str) -> int:
    """Wait until both charts hold as many samples as the API has of the sandbox (its sampler
    may add one meanwhile: then the page follows), and say how many."""
    counts: list[int] = []

    async def same() -> bool:
        samples = (await site.api.get(f"/sandboxes/{sandbox_id}/metrics")).json()
        drawn = await page.locator("figure.chart").evaluate_all(
            "(figures) => figures.map((f) => Number(f.dataset.drawn))"
        )
        counts[:] = [len(samples)]
        return bool(drawn == [len(samples), len(samples)])

    await eventually(same, "the charts hold the API's samples", interval=0.1)
    return counts[0]


async def blue_pixels(page: Page, metric: str) -> int:
    """How many pixels of a chart's canvas are its series' blue (or its fill over white)."""
    count: int = await page.locator(f'figure.chart[data-metric="{metric}"] canvas').evaluate(
        """(canvas) => {
            const { width, height } = canvas;
            const { data } = canvas.getContext("2d").getImageData(0, 0, width, height);
            let blue = 0;
            for (let i = 0; i < data.length; i += 4) {
                const [r, b, a] = [data[i], data[i + 2], data[i + 3]];
                if (a > 0 && b > 200 && r < 240 && b - r > 15) {
                    blue++;
                }
            }
            return blue;
        }"""
    )
    return count


async def test_a_thousand_sandboxes_are_paged(site: Site, url: str, page: Page) -> None:
    """1,000 sandboxes (rows written into the catalog, which is all the list reads): each page
    shows 50, and following "Next page" shows every sandbox once. How fast the first page
    renders is measured by bench/dashboard.py (docs/benchmarks/dashboard.md), not here."""
    now = time.time()
    for n in range(1000):
        site.orchestrator.catalog.insert(
            SandboxRecord(
                id=f"many{n:016d}", template_id="base", state=SandboxState.RUNNING,
                cpu_count=1, memory_mb=512, disk_size_mb=1024, started_at=now - n,
                end_at=now + 3600, metadata={"n": str(n)}, env_vars={},
                envd_access_token="token", restored_from="/t/base", timeout=3600,
                auto_pause_mode=SaveMode.FULL, network=SandboxNetwork(),
            )
        )  # fmt: skip
    try:
        await sign_in(page, url)
        seen: set[str] = set()
        rows = page.locator("tr[data-sandbox]")
        for pages in range(1, 21):
            await expect(rows).to_have_count(50)
            shown = await rows.evaluate_all("(rows) => rows.map((r) => r.dataset.sandbox)")
            assert not seen & set(shown)
            seen |= set(shown)
            if pages < 20:
                await page.click("a[rel=next]")
        assert len(seen) == 1000
        assert await page.locator("a[rel=next]").count() == 0
        # The metadata filter finds one among them.
        await page.goto(f"{url}/dashboard/sandboxes?metadata=n%3D999")
        await expect(rows).to_have_count(1)
        await expect(rows).to_have_attribute("data-sandbox", f"many{999:016d}")
    finally:
        # Rows without VMs: dropped here, not killed one by one by the node's close.
        for n in range(1000):
            site.orchestrator.catalog.delete(f"many{n:016d}")
