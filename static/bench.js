/* Bench page charts: one metric against overlap level (x = 1, 2, 4, 8 …), one series per mode.

   Hearth.chart draws time series; here x is the overlap level, so these small uPlot charts are
   drawn once from {x: [levels], series: {mode: [values]}, unit} (a finished session does not
   change). Hearth.benchCharts holds them (tests read their point counts). */
(function () {
  "use strict";

  const Hearth = (window.Hearth = window.Hearth || {});
  Hearth.benchCharts = [];
  const PALETTE = { continuous: "#e8590c", serial: "#1c7ed6", static: "#2b8a3e", "llama-server": "#ae3ec9", target: "#868e96" };

  function label(value, unit) {
    if (value === null || value === undefined) return "–";
    if (unit === "") return (value * 100).toFixed(0) + " %";
    return (window.Hearth.format ? Hearth.format(value, unit) : value.toFixed(1) + " " + unit);
  }

  async function draw(el) {
    const overlay = document.createElement("div");
    overlay.className = "chart-empty";
    overlay.textContent = "Loading…";
    el.appendChild(overlay);
    let json;
    try {
      const response = await fetch(el.dataset.benchChart, { headers: { Accept: "application/json" }, credentials: "same-origin" });
      if (!response.ok) {
        overlay.textContent = "Chart data unavailable (HTTP " + response.status + ").";
        return;
      }
      json = await response.json();
    } catch (error) {
      overlay.textContent = "Cannot reach Hearth.";
      return;
    }
    const names = Object.keys(json.series || {});
    const data = [json.x || []].concat(names.map((n) => json.series[n]));
    const points = data.slice(1).reduce((n, s) => n + s.filter((v) => v !== null && v !== undefined).length, 0);
    const chart = { el: el, names: names, points: points, plot: null };
    Hearth.benchCharts.push(chart);
    if (points === 0 || typeof uPlot === "undefined") {
      overlay.textContent = points === 0 ? "No data (the server did not report this)." : "Charts need the front-end libraries.";
      return;
    }
    overlay.hidden = true;
    const unit = json.unit;
    chart.plot = new uPlot({
      width: Math.max(el.clientWidth, 240),
      height: 200,
      scales: { x: { time: false, distr: 2 }, y: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] } },
      axes: [
        { label: "requests at once", values: (u, splits) => splits.map((v) => String(v)) },
        { size: 70, values: (u, splits) => splits.map((v) => label(v, unit)) },
      ],
      series: [{ label: "overlap" }].concat(names.map((n, i) => ({
        label: n,
        stroke: PALETTE[n] || ["#f59f00", "#0ca678", "#e64980"][i % 3],
        width: 2,
        points: { show: true, size: 6 },
        value: (u, v) => label(v, unit),
      }))),
    }, data, el);
    if (window.ResizeObserver) {
      new ResizeObserver(() => chart.plot.setSize({ width: Math.max(el.clientWidth, 240), height: 200 })).observe(el);
    }
  }

  document.querySelectorAll("[data-bench-chart]").forEach(draw);
})();
