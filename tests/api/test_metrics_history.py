"""The metrics history over a node on doubles, served on loopback: samples taken while a
sandbox runs are served by time range, kept while it is paused and dropped once it is gone."""

from __future__ import annotations

import time
from pathlib import Path

from aenv.orchestrator.metrics_history import MetricsHistory
from tests.api.test_routes import served
from tests.doubles.node import double_node


async def test_history_by_range_across_pause_and_resume(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        sandbox = (await api.post("/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        other = (await api.post("/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        orc = node.orchestrator
        # An interval no test run outlasts: a read never adds a fresh sample to the history.
        orc.metrics = MetricsHistory(interval=3600.0, retention=36000.0)
        before = int(time.time()) - 1
        await orc.sample_metrics()  # the sampler's rounds, run here instead of on its timer
        await orc.sample_metrics()
        url = f"/sandboxes/{sandbox}/metrics"
        assert (await api.post(f"/sandboxes/{sandbox}/pause")).status_code == 204
        await orc.sample_metrics()  # paused: not sampled, history kept
        paused = (await api.get(url)).json()
        assert len(paused) == 2 and all(m["cpuUsedPct"] == 1.5 for m in paused)
        assert (await api.get(url, params={"end": before})).json() == []
        assert (await api.get(url, params={"start": int(time.time()) + 60})).json() == []
        resumed = await api.post(f"/sandboxes/{sandbox}/connect", json={"timeout": 60})
        assert resumed.status_code == 201, resumed.text
        await orc.sample_metrics()
        after = (await api.get(url, params={"start": before})).json()
        assert len(after) == 3
        stamps = [m["timestampUnix"] for m in after]
        assert stamps == sorted(stamps) and stamps[0] >= before
        assert (await api.delete(f"/sandboxes/{other}")).status_code == 204
        await orc.sample_metrics()
        assert orc.metrics.latest(other) is None  # gone with its sandbox
        assert orc.metrics.latest(sandbox) is not None


def test_retention_bounds_the_samples_kept() -> None:
    history = MetricsHistory(interval=1.0, retention=3.0)
    for n in range(5):
        history.add("sbx", {"n": float(n)})
    assert [s.values["n"] for s in history.between("sbx", 0, 2**40)] == [2.0, 3.0, 4.0]
