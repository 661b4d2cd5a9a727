"""The metrics history over a node on doubles, served on loopback: samples taken while a
sandbox runs are served by time range, kept while it is paused and dropped once it is gone; the
CPU figure comes from the VMM on the host every round, the guest is asked for its own figures
only when it did work or its newest figures are old."""

from __future__ import annotations

import time
from pathlib import Path

from aenv.orchestrator.metrics_history import MetricsHistory
from aenv.runtime.driver import CPUTime
from tests.api.test_routes import served
from tests.doubles.node import double_node

MIB = 1 << 20


async def test_history_by_range_across_pause_and_resume(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        sandbox = (await api.post("/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        other = (await api.post("/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        orc = node.orchestrator
        # An interval no test run outlasts: a read never adds a fresh sample to the history.
        orc.metrics = MetricsHistory(interval=3600.0, retention=36000.0)
        before = int(time.time()) - 1
        await orc.sample_metrics()  # the sampler's rounds, run here instead of on its timer
        node.vm(sandbox).cpu_seconds += 0.5  # the guest worked between the two rounds
        await orc.sample_metrics()
        url = f"/sandboxes/{sandbox}/metrics"
        assert (await api.post(f"/sandboxes/{sandbox}/pause")).status_code == 204
        await orc.sample_metrics()  # paused: not sampled, history kept
        paused = (await api.get(url)).json()
        assert len(paused) == 2 and all(m["memUsed"] == 100 * MIB for m in paused)
        assert [m["cpuUsedPct"] > 0 for m in paused] == [False, True]
        assert (await api.get(url, params={"end": before})).json() == []
        assert (await api.get(url, params={"start": int(time.time()) + 60})).json() == []
        resumed = await api.post(f"/sandboxes/{sandbox}/connect", json={"timeout": 60})
        assert resumed.status_code == 201, resumed.text
        await orc.sample_metrics()
        after = (await api.get(url, params={"start": before})).json()
        assert len(after) == 3 and after[2]["memTotal"] == 512 * MIB
        stamps = [m["timestampUnix"] for m in after]
        assert stamps == sorted(stamps) and stamps[0] >= before
        assert (await api.delete(f"/sandboxes/{other}")).status_code == 204
        await orc.sample_metrics()
        assert orc.metrics.latest(other) is None  # gone with its sandbox
        assert orc.metrics.latest(sandbox) is not None


async def test_an_idle_sandbox_costs_its_guest_no_request(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        sandbox = (await api.post("/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        orc = node.orchestrator
        orc.metrics = MetricsHistory(interval=3600.0, retention=36000.0, guest_interval=3600.0)
        guest, vm = node.guest(sandbox), node.vm(sandbox)
        asked = guest.metrics_asked
        await orc.sample_metrics()
        assert guest.metrics_asked == asked + 1  # no figures of the guest yet
        for _ in range(3):
            await orc.sample_metrics()
        assert guest.metrics_asked == asked + 1  # idle: its VMM's CPU is read on the host only
        vm.cpu_seconds += 1.0
        await orc.sample_metrics()
        assert guest.metrics_asked == asked + 2  # it did work: its memory may have moved
        await orc.sample_metrics()
        assert guest.metrics_asked == asked + 2
        # Reads of the current figures between rounds take the history's newest.
        batch = await api.get("/sandboxes/metrics", params={"sandbox_ids": sandbox})
        assert batch.json()["sandboxes"][sandbox]["memUsed"] == 100 * MIB
        assert guest.metrics_asked == asked + 2
        history = (await api.get(f"/sandboxes/{sandbox}/metrics")).json()
        assert len(history) == 6 and [m["cpuUsedPct"] > 0 for m in history[3:5]] == [False, True]
        # Old guest figures are refreshed even when the guest stays idle.
        orc.metrics.guest_interval = 0.0
        await orc.sample_metrics()
        assert guest.metrics_asked == asked + 3


def test_cpu_share_is_the_vmm_use_since_the_previous_reading() -> None:
    history = MetricsHistory(guest_interval=3600.0)
    started = time.time() - 10.0
    guest = {"cpu_count": 2.0, "mem_used": 1.0}
    first = history.record("sbx", CPUTime(100.0, started), guest)
    assert first.values["cpu_used_pct"] == 100.0  # more than both vCPUs since it started: capped
    assert not history.needs_guest("sbx", CPUTime(100.0, started))
    again = history.record("sbx", CPUTime(100.0, started), None)
    assert again.values == {"cpu_count": 2.0, "mem_used": 1.0, "cpu_used_pct": 0.0}
    assert history.needs_guest("sbx", CPUTime(200.0, started))
    # Another VMM process (a resume): its use counts from its own start, not the old reading.
    restarted = CPUTime(0.0, time.time() - 10.0)
    assert history.record("sbx", restarted, None).values["cpu_used_pct"] == 0.0
    history.keep_only([])
    assert history.needs_guest("sbx", restarted) and history.latest("sbx") is None


def test_retention_bounds_the_samples_kept() -> None:
    history = MetricsHistory(interval=1.0, retention=3.0)
    for n in range(5):
        history.add("sbx", {"n": float(n)})
    assert [s.values["n"] for s in history.between("sbx", 0, 2**40)] == [2.0, 3.0, 4.0]
