"""Matplotlib figures arrive as the SDK's chart objects beside their PNG: the chart types of
`e2b_code_interpreter.charts`, read by the unmodified SDK from our server's results."""

from __future__ import annotations

import pytest
from e2b_code_interpreter import Sandbox
from e2b_code_interpreter.charts import (
    BarChart,
    BoxAndWhiskerChart,
    Chart,
    ChartType,
    LineChart,
    PieChart,
    ScaleType,
    ScatterChart,
    SuperChart,
)

PLT = "import matplotlib.pyplot as plt\n"


def _chart(sandbox: Sandbox, code: str) -> Chart:
    execution = sandbox.run_code(PLT + code + "\nplt.show()")
    assert execution.error is None, execution.error
    [figure] = execution.results
    assert figure.png is not None
    assert figure.chart is not None
    assert "chart" in figure.formats()
    return figure.chart


def test_line_chart(sandbox: Sandbox) -> None:
    chart = _chart(
        sandbox,
        "plt.plot([1, 2, 3], [3, 1, 2], label='a')\nplt.plot([1, 2, 3], [0, 5, 1], label='b')\n"
        "plt.title('Lines'); plt.xlabel('time'); plt.ylabel('value')",
    )
    assert isinstance(chart, LineChart) and chart.type is ChartType.LINE
    assert (chart.title, chart.x_label, chart.y_label) == ("Lines", "time", "value")
    assert chart.x_scale is ScaleType.LINEAR
    assert [(e.label, e.points) for e in chart.elements] == [
        ("a", [(1.0, 3.0), (2.0, 1.0), (3.0, 2.0)]),
        ("b", [(1.0, 0.0), (2.0, 5.0), (3.0, 1.0)]),
    ]
    assert len(chart.x_ticks) == len(chart.x_tick_labels) > 0


def test_scatter_chart_with_log_scale(sandbox: Sandbox) -> None:
    chart = _chart(sandbox, "plt.scatter([1, 10, 100], [2, 4, 8], label='s')\nplt.xscale('log')")
    assert isinstance(chart, ScatterChart)
    assert chart.x_scale is ScaleType.LOG and chart.y_scale is ScaleType.LINEAR
    [series] = chart.elements
    assert (series.label, series.points) == ("s", [(1.0, 2.0), (10.0, 4.0), (100.0, 8.0)])


def test_bar_chart_groups_and_categories(sandbox: Sandbox) -> None:
    chart = _chart(
        sandbox,
        "plt.bar(['x', 'y'], [3, 5], label='first')\nplt.title('Bars')",
    )
    assert isinstance(chart, BarChart) and chart.title == "Bars"
    assert [(e.label, e.group, e.value) for e in chart.elements] == [
        ("x", "first", 3.0),
        ("y", "first", 5.0),
    ]


def test_pie_chart(sandbox: Sandbox) -> None:
    chart = _chart(sandbox, "plt.pie([1, 3], labels=['small', 'big'])\nplt.title('Pie')")
    assert isinstance(chart, PieChart) and chart.title == "Pie"
    assert [e.label for e in chart.elements] == ["small", "big"]
    assert [round(e.angle) for e in chart.elements] == [90, 270]
    assert all(e.radius == 1.0 for e in chart.elements)


def test_a_pie_shares_angles_are_whole_degrees(sandbox: Sandbox) -> None:
    """From 90 degrees, a 90 % wedge ends at 414: 414 - 90 is 323.99999999999994 in floats."""
    chart = _chart(sandbox, "plt.pie([90, 10], labels=['a', 'b'], startangle=90)")
    assert isinstance(chart, PieChart)
    assert [e.angle for e in chart.elements] == [324, 36]


def test_units_are_what_labels_end_with(sandbox: Sandbox) -> None:
    chart = _chart(
        sandbox, "plt.plot([1, 2], [3, 4])\nplt.xlabel('Time (s)'); plt.ylabel('Mass [kg]')"
    )
    assert isinstance(chart, LineChart)
    assert (chart.x_label, chart.x_unit, chart.y_unit) == ("Time (s)", "s", "kg")
    plain = _chart(sandbox, "plt.plot([1, 2], [3, 4])\nplt.xlabel('Class')")
    assert isinstance(plain, LineChart) and (plain.x_unit, plain.y_unit) == (None, None)


def test_no_title_is_none(sandbox: Sandbox) -> None:
    chart = _chart(sandbox, "plt.scatter([1, 2], [3, 4], label='s')")
    assert isinstance(chart, ScatterChart) and chart.title is None


@pytest.mark.parametrize("patch_artist", [False, True])
def test_box_and_whisker_chart(sandbox: Sandbox, patch_artist: bool) -> None:
    chart = _chart(
        sandbox,
        "plt.boxplot([[1, 2, 3, 4, 5, 40], [10, 11, 12, 13, 14]], "
        f"tick_labels=['A', 'B'], patch_artist={patch_artist})\nplt.ylabel('score')",
    )
    assert isinstance(chart, BoxAndWhiskerChart) and chart.y_label == "score"
    a, b = chart.elements
    # Quartiles as numpy computes them; 40 lies beyond 1.5 IQR, so it is an outlier.
    assert (a.label, a.min, a.first_quartile, a.median, a.third_quartile, a.max) == (
        "A", 1.0, 2.25, 3.5, 4.75, 5.0,
    )  # fmt: skip
    assert a.outliers == [40.0]
    assert (b.label, b.min, b.median, b.max, b.outliers) == ("B", 10.0, 12.0, 14.0, [])


def test_figure_with_two_axes_is_a_superchart(sandbox: Sandbox) -> None:
    chart = _chart(
        sandbox,
        "fig, (left, right) = plt.subplots(1, 2)\nfig.suptitle('Both')\n"
        "left.plot([1, 2], [1, 2])\nright.bar(['q'], [7])",
    )
    assert isinstance(chart, SuperChart) and chart.title == "Both"
    assert [type(c) for c in chart.elements] == [LineChart, BarChart]


def test_dates_on_the_x_axis(sandbox: Sandbox) -> None:
    chart = _chart(
        sandbox,
        "import datetime\nd = [datetime.date(2024, 1, 1), datetime.date(2024, 1, 2)]\n"
        "plt.plot(d, [1, 2])",
    )
    assert isinstance(chart, LineChart) and chart.x_scale is ScaleType.DATETIME
    assert chart.elements[0].points == [("2024-01-01", 1.0), ("2024-01-02", 2.0)]


def test_an_image_is_no_known_chart(sandbox: Sandbox) -> None:
    chart = _chart(sandbox, "plt.imshow([[0, 1], [1, 0]])")
    assert chart.type is ChartType.UNKNOWN and chart.elements == []
