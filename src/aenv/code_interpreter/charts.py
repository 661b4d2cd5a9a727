"""Charts: the data of a matplotlib figure as the SDKs' chart objects (`e2b_code_interpreter`
`charts`), sent beside the figure's PNG as the result's `chart`.

It runs inside the kernel, called by the display formatter the start-up code registers for
matplotlib figures. An axes is read by what it holds: only lines is a line chart, only
scatter collections a scatter chart, only bar containers' rectangles a bar chart, only wedges
a pie, and box-plot boxes with their lines a box-and-whisker chart; anything else is
`unknown`. A figure with several axes is a `superchart` of one chart per axes.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.collections import PathCollection
from matplotlib.container import BarContainer
from matplotlib.dates import num2date
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import PathPatch, Rectangle, Wedge

Chart = dict[str, Any]
# Matplotlib's scales and the SDK's names for them (its ScaleType).
_SCALES = {"linear", "log", "symlog", "logit", "function", "functionlog", "asinh"}


_UNIT = re.compile(r"\(([^()]+)\)\s*$|\[([^\[\]]+)\]\s*$")


def figure_chart(figure: Figure) -> Chart | None:
    """The figure's chart, None for a figure without axes."""
    axes = figure.get_axes()
    if not axes:
        return None
    if len(axes) == 1:
        chart = axes_chart(axes[0])
        chart["title"] = chart["title"] or _suptitle(figure)
        return chart
    elements = [axes_chart(ax) for ax in axes]
    return {"type": "superchart", "title": _suptitle(figure), "elements": elements}


def axes_chart(ax: Axes) -> Chart:
    # What was plotted: not the axes' own frame, texts, legend or ticks.
    artists = [*ax.lines, *ax.collections, *ax.patches, *ax.images, *ax.tables]
    lines = [a for a in artists if isinstance(a, Line2D)]
    boxes = [a for a in lines if _is_box(a)] + [a for a in artists if isinstance(a, PathPatch)]
    if boxes and all(isinstance(a, (Line2D, PathPatch)) for a in artists):
        return _box_chart(ax, boxes, [a for a in lines if not _is_box(a)])
    if artists and len(lines) == len(artists):
        return _point_chart(ax, "line", [(a.get_label(), _line_points(a)) for a in lines])
    if artists and all(isinstance(a, PathCollection) for a in artists):
        collections = [a for a in artists if isinstance(a, PathCollection)]
        return _point_chart(ax, "scatter", [(c.get_label(), _offsets(c)) for c in collections])
    if artists and all(isinstance(a, Wedge) for a in artists):
        wedges = [a for a in artists if isinstance(a, Wedge)]
        return {"type": "pie", "title": _title(ax), "elements": [_wedge(w) for w in wedges]}
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    if bars and all(isinstance(a, Rectangle) for a in artists):
        return _bar_chart(ax, bars)
    return {"type": "unknown", "title": _title(ax), "elements": []}


# No title is None in the SDKs' charts, not "".
def _title(ax: Axes) -> str | None:
    return ax.get_title() or None


def _suptitle(figure: Figure) -> str | None:
    return figure.get_suptitle() or None


def _labels(ax: Axes) -> Chart:
    return {
        "title": _title(ax),
        "x_label": ax.get_xlabel() or None,
        "y_label": ax.get_ylabel() or None,
        "x_unit": _unit(ax.get_xlabel()),
        "y_unit": _unit(ax.get_ylabel()),
    }


def _unit(label: str) -> str | None:
    """The unit a label names at its end, in parentheses or brackets: `Time (s)` is in s."""
    found = _UNIT.search(label)
    return found.group(1) or found.group(2) if found else None


def _point_chart(ax: Axes, kind: str, series: Sequence[tuple[object, list[list[Any]]]]) -> Chart:
    return {
        "type": kind,
        **_labels(ax),
        **_axis("x", ax.xaxis, ax.get_xscale()),
        **_axis("y", ax.yaxis, ax.get_yscale()),
        "elements": [{"label": str(label), "points": points} for label, points in series],
    }


def _axis(name: str, axis: Axis, scale: str) -> Chart:
    ticks = [float(t) for t in axis.get_majorticklocs()]
    # Tick texts are set when the figure is drawn; the formatter gives them without a draw.
    labels = [str(text) for text in axis.get_major_formatter().format_ticks(ticks)]
    kind = _scale(axis, scale)
    values: list[Any] = ticks
    if kind == "datetime":
        values = [num2date(t).isoformat() for t in ticks]  # type: ignore[no-untyped-call]
    elif kind == "categorical":
        values = labels
    return {f"{name}_ticks": values, f"{name}_tick_labels": labels, f"{name}_scale": kind}


def _scale(axis: Axis, scale: str) -> str:
    converter = type(axis.get_converter()).__name__ if axis.get_converter() else ""
    if "Date" in converter:
        return "datetime"
    if "StrCategory" in converter:
        return "categorical"
    return scale if scale in _SCALES else "unknown"


def _line_points(line: Line2D) -> list[list[Any]]:
    xs, ys = line.get_xdata(orig=True), line.get_ydata(orig=True)
    return [[_value(x), _value(y)] for x, y in zip(np.asarray(xs), np.asarray(ys), strict=True)]


def _offsets(collection: PathCollection) -> list[list[Any]]:
    return [[_value(x), _value(y)] for x, y in np.asarray(collection.get_offsets())]


def _value(value: object) -> float | str:
    """A point's coordinate as JSON: a number, a date's ISO text, else its text."""
    if isinstance(value, np.datetime64):
        return str(np.datetime_as_string(value))
    if isinstance(value, datetime.date):
        return value.isoformat()
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return str(value)


def _wedge(wedge: Wedge) -> Chart:
    return {
        "label": wedge.get_label(),
        # A wedge's angles are its start plus its share of 360: 90 + 324 - 90 is not 324 in
        # floats, and a 90 % share is 324 degrees to the SDKs' users (and E2B's tests).
        "angle": round(float(abs(wedge.theta2 - wedge.theta1)), 9),
        "radius": float(wedge.r),
    }


def _bar_chart(ax: Axes, containers: list[BarContainer]) -> Chart:
    elements = []
    for container in containers:
        horizontal = getattr(container, "orientation", "vertical") == "horizontal"
        axis = ax.yaxis if horizontal else ax.xaxis
        ticks = list(axis.get_majorticklocs())
        labels = axis.get_major_formatter().format_ticks(ticks)
        for rect in container.patches:
            if horizontal:
                center, value = rect.get_y() + rect.get_height() / 2, rect.get_width()
            else:
                center, value = rect.get_x() + rect.get_width() / 2, rect.get_height()
            elements.append(
                {
                    "label": _nearest_label(center, ticks, labels),
                    "group": str(container.get_label()),
                    "value": float(value),
                }
            )
    return {"type": "bar", **_labels(ax), "elements": elements}


def _nearest_label(position: float, ticks: Sequence[float], labels: Sequence[str]) -> str:
    if not ticks:
        return str(position)
    nearest = min(range(len(ticks)), key=lambda i: abs(ticks[i] - position))
    return str(labels[nearest])


def _is_box(line: Line2D) -> bool:
    """A box of `boxplot` without `patch_artist`: a closed rectangle of five points."""
    xs, ys = _numbers(line)
    return (
        len(xs) == 5
        and xs[0] == xs[4]
        and ys[0] == ys[4]
        and len(set(xs.tolist())) == 2
        and len(set(ys.tolist())) == 2
    )


def _numbers(line: Line2D) -> tuple[Any, Any]:
    """The line's points in axes units (dates and categories converted to numbers)."""
    xs = np.asarray(line.get_xdata(orig=False), float)
    return xs, np.asarray(line.get_ydata(orig=False), float)


def _extent(box: Line2D | PathPatch) -> tuple[float, float, float, float]:
    if isinstance(box, Line2D):
        xs, ys = _numbers(box)
    else:
        vertices = np.asarray(box.get_path().vertices, float)
        xs, ys = vertices[:, 0], vertices[:, 1]
    return float(xs.min()), float(xs.max()), float(ys.min()), float(ys.max())


def _box_chart(ax: Axes, boxes: list[Line2D | PathPatch], lines: list[Line2D]) -> Chart:
    """Vertical box plots: per box, its quartiles from the rectangle, the median from the
    horizontal line across it, min and max from the whiskers' ends, outliers from the markers
    above or below them."""
    ticks = list(ax.xaxis.get_majorticklocs())
    labels = ax.xaxis.get_major_formatter().format_ticks(ticks)
    elements = []
    for box in sorted(boxes, key=lambda b: _extent(b)[0]):
        left, right, q1, q3 = _extent(box)
        center = (left + right) / 2
        median, low, high, outliers = (q1 + q3) / 2, q1, q3, []
        for line in lines:
            xs, ys = _numbers(line)
            if not len(xs) or xs.min() < left or xs.max() > right:
                continue
            if line.get_linestyle() in ("None", "none", ""):
                outliers += [float(y) for y in ys]
            elif len(xs) == 2 and xs[0] == xs[1]:  # a whisker, from a quartile outwards
                low, high = min(low, float(ys.min())), max(high, float(ys.max()))
            elif len(xs) == 2 and ys[0] == ys[1] and xs[0] == left and xs[1] == right:
                median = float(ys[0])
        elements.append(
            {
                "label": _nearest_label(center, ticks, labels),
                "min": low,
                "first_quartile": q1,
                "median": median,
                "third_quartile": q3,
                "max": high,
                "outliers": outliers,
            }
        )
    return {"type": "box_and_whisker", **_labels(ax), "elements": elements}
