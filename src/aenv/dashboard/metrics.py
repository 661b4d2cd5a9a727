"""CPU and memory as the pages show them, from the API's samples (E2B's `SandboxMetric`): the
sandbox list's sparklines (SVG drawn here, with the samples the list pages have seen), and one
sandbox's charts over time (the columns uPlot draws in the browser, `static/charts.js`)."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

# The list's sparklines: so many samples per sandbox, of so many sandboxes at most.
SPARK_SAMPLES = 30
TRACKED = 5000
_MIB = 1 << 20


def _now(samples: list[dict[str, Any]]) -> tuple[str, str]:
    """The latest CPU and memory as text: `12%`, `120 / 512 MiB` (`-` without a sample)."""
    if not samples:
        return "-", "-"
    latest = samples[-1]
    memory = f"{latest['memUsed'] // _MIB} / {latest['memTotal'] // _MIB} MiB"
    return f"{latest['cpuUsedPct']:.0f}%", memory


class Metrics:
    """A list row's CPU and memory: sparklines (SVG polyline points in a box of `width` by
    `height`) and their latest values. Drawn here rather than by the charting library: a page
    of the list holds up to 100 of them, replaced whole at every live update, and a polyline
    costs the browser nothing to draw and needs no script."""

    def __init__(self, samples: list[dict[str, Any]], width: int = 80, height: int = 20) -> None:
        size = (width, height)
        self.cpu = _points([s["cpuUsedPct"] for s in samples], 100.0, size)
        total = max((s["memTotal"] for s in samples), default=0)
        self.memory = _points([s["memUsed"] for s in samples], float(total), size)
        self.cpu_now, self.memory_now = _now(samples)
        self.width, self.height = width, height


def _points(values: list[float], top: float, size: tuple[int, int]) -> str:
    """A polyline's points for `values` on a scale from 0 to `top`, oldest at the left, in a
    box of `size` (width, height)."""
    if not values or top <= 0:
        return ""
    if len(values) == 1:  # one sample: a level line, not a point nobody sees
        values = values * 2
    width, height = size
    step = width / max(len(values) - 1, 1)
    return " ".join(
        f"{i * step:.1f},{height - min(v / top, 1.0) * height:.1f}" for i, v in enumerate(values)
    )


class Charts:
    """One sandbox's CPU and memory over time, as its page's charts take them: uPlot's data,
    columns of equal length, the first the samples' times (Unix seconds, the x axis) and the
    others the values in the units the y axis shows (CPU in %, memory used and total in MiB)."""

    def __init__(self, samples: list[dict[str, Any]], unavailable: str | None = None) -> None:
        self.unavailable = unavailable
        times = [s["timestampUnix"] for s in samples]
        self.cpu: list[list[float]] = [times, [s["cpuUsedPct"] for s in samples]]
        self.memory: list[list[float]] = [
            times,
            [round(s["memUsed"] / _MIB, 1) for s in samples],
            [round(s["memTotal"] / _MIB, 1) for s in samples],
        ]
        self.cpu_now, self.memory_now = _now(samples)


class RecentSamples:
    """The last samples the list pages were given per sandbox, for their rows' sparklines: at
    most `SPARK_SAMPLES` each, of the `TRACKED` sandboxes seen last (the list shows a page of
    each session's own; another key's rows never render from it)."""

    def __init__(self) -> None:
        self._samples: OrderedDict[str, deque[dict[str, Any]]] = OrderedDict()

    def add(self, sandbox_id: str, sample: dict[str, Any]) -> None:
        kept = self._samples.pop(sandbox_id, None) or deque(maxlen=SPARK_SAMPLES)
        if not kept or kept[-1].get("timestampUnix") != sample.get("timestampUnix"):
            kept.append(sample)
        self._samples[sandbox_id] = kept
        while len(self._samples) > TRACKED:
            self._samples.popitem(last=False)

    def of(self, sandbox_id: str) -> list[dict[str, Any]]:
        return list(self._samples.get(sandbox_id, ()))
