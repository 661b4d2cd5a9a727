// One sandbox's CPU and memory over time: uPlot charts (static/vendor/) of the columns the
// server renders into each figure's data-series (dashboard/metrics.py: times in Unix seconds,
// CPU in %, memory in MiB). The panels are replaced at every live update (dashboard.js says so
// with a "replaced" event): each chart is made once, then moved into the new figure and given
// its new data, so it follows the sandbox without being made again.
"use strict";

const HEIGHT = 200;
const BLUE = "#2962ff";
const METRICS = {
  cpu: {
    unit: "%",
    label: "CPU used (%)",
    range: [0, 100],
    series: [{ label: "CPU used", stroke: BLUE, fill: "rgba(41, 98, 255, 0.1)" }],
  },
  memory: {
    unit: "MiB",
    label: "memory (MiB)",
    range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1],
    series: [
      { label: "used", stroke: BLUE, fill: "rgba(41, 98, 255, 0.1)" },
      { label: "total", stroke: "#9e9e9e", dash: [4, 4] },
    ],
  },
};
const charts = new Map(); // metric -> its uPlot chart
// The API's times are UTC, as the events' on this page are: the charts say them so, in 24 h.
const utc = (ts) => uPlot.tzDate(new Date(ts * 1000), "Etc/UTC");
const clock = uPlot.fmtDate("{HH}:{mm}:{ss}");
const stamp = uPlot.fmtDate("{YYYY}-{MM}-{DD} {HH}:{mm}:{ss}");

// At least a minute across, centred on the samples: a sandbox just created has one, which
// uPlot alone would show a day wide, and a few seconds would have the axis repeat its labels.
function minute(u, min, max) {
  const times = u.data[0];
  if (times.length === 1) {
    [min, max] = [times[0], times[0]];
  }
  const pad = Math.max(0, 60 - (max - min)) / 2;
  return [min - pad, max + pad];
}

function width(figure) {
  return Math.max(240, figure.clientWidth - 16);
}

function options(metric, figure) {
  const { unit, label, range, series } = METRICS[metric];
  const value = (u, v) => (v == null ? "-" : `${v} ${unit}`);
  return {
    width: width(figure),
    height: HEIGHT,
    tzDate: utc,
    scales: { x: { time: true, range: minute }, y: { range } },
    axes: [
      { label: "time (UTC)", values: (u, ticks) => ticks.map((ts) => clock(utc(ts))) },
      { label, size: 60 },
    ],
    series: [
      { label: "time", value: (u, ts) => (ts == null ? "-" : stamp(utc(ts))) },
      ...series.map((s) => ({ ...s, value })),
    ],
  };
}

function draw() {
  for (const figure of document.querySelectorAll("figure.chart[data-series]")) {
    const metric = figure.dataset.metric;
    const data = JSON.parse(figure.dataset.series);
    let chart = charts.get(metric);
    if (chart) {
      figure.append(chart.root);
      chart.setData(data);
    } else {
      chart = new uPlot(options(metric, figure), data, figure);
      charts.set(metric, chart);
    }
    // How many samples the chart holds, as it says: what the page's tests compare to the API.
    figure.dataset.drawn = String(chart.data[0].length);
  }
}

draw();
document.getElementById("sandbox-panels").addEventListener("replaced", draw);
window.addEventListener("resize", () => {
  for (const [metric, chart] of charts) {
    const figure = document.querySelector(`figure.chart[data-metric="${metric}"]`);
    if (figure) {
      chart.setSize({ width: width(figure), height: HEIGHT });
    }
  }
});
