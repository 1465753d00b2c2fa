/* Bench page charts: one metric against overlap level (x = 1, 2, 4, 8 …), one series per mode.

   Hearth.chart draws time series; here x is the overlap level, so these small uPlot charts are
   drawn once from {x: [levels], series: {mode: [values]}, unit} (a finished session does not
   change). The x scale is log 2, so levels 1, 2, 4 … 64 sit evenly apart, with a tick at every
   measured level, and one level alone still gets an axis around it. Charts are drawn on load and
   again whenever htmx swaps in a session (the progress poll does when a run ends).
   Hearth.benchCharts holds the charts on the page (tests read their point counts). */
(function () {
  "use strict";

  const Hearth = (window.Hearth = window.Hearth || {});
  Hearth.benchCharts = [];
  const PALETTE = { continuous: "#e8590c", serial: "#1c7ed6", static: "#2b8a3e", "llama-server": "#ae3ec9", target: "#868e96" };
  const EXTRA = ["#f59f00", "#0ca678", "#e64980", "#7048e8", "#1098ad"];
  const HEIGHT = 200;
  const Y_AXIS_PX = 88; // room for "120.0 tok/s" or "1,500 ms" beside the plot

  function label(value, unit) {
    if (value === null || value === undefined) return "–";
    // A share: small ones keep a decimal, so an axis of 0.2 %, 0.4 % … does not read "0 %" throughout.
    if (unit === "") return (value * 100).toFixed(value < 0.1 && value > 0 ? 1 : 0) + " %";
    return (window.Hearth.format ? Hearth.format(value, unit) : value.toFixed(1) + " " + unit);
  }

  function colour(name, i) {
    const mode = name.split(" · ")[0];
    return name === mode && PALETTE[mode] ? PALETTE[mode] : EXTRA[i % EXTRA.length];
  }

  async function draw(el) {
    if (el.dataset.drawn) return;
    el.dataset.drawn = "1";
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
    const levels = json.x || [];
    const names = Object.keys(json.series || {});
    const data = [levels].concat(names.map((n) => json.series[n]));
    const points = data.slice(1).reduce((n, s) => n + s.filter((v) => v !== null && v !== undefined).length, 0);
    const chart = { el: el, names: names, points: points, levels: levels, plot: null };
    Hearth.benchCharts = Hearth.benchCharts.filter((c) => c.el.isConnected);
    Hearth.benchCharts.push(chart);
    if (points === 0 || typeof uPlot === "undefined") {
      overlay.textContent = points === 0 ? "No data (the server did not report this)." : "Charts need the front-end libraries.";
      return;
    }
    // The label has done its job: .chart-empty is display:flex, which would win over [hidden].
    overlay.remove();
    const unit = json.unit;
    const lo = Math.min.apply(null, levels);
    const hi = Math.max.apply(null, levels);
    chart.plot = new uPlot({
      width: Math.max(el.clientWidth, 240),
      height: HEIGHT,
      scales: {
        // Half a step of room either side, so one level alone is drawn in the middle of an axis.
        x: { time: false, distr: 3, log: 2, range: () => [lo / Math.SQRT2, hi * Math.SQRT2] },
        y: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] },
      },
      axes: [
        { label: "requests at once", splits: () => levels, values: (u, splits) => splits.map((v) => String(v)) },
        { size: Y_AXIS_PX, values: (u, splits) => splits.map((v) => label(v, unit)) },
      ],
      series: [{ label: "overlap", value: (u, v) => (v === null || v === undefined ? "–" : String(v)) }].concat(names.map((n, i) => ({
        label: n,
        stroke: colour(n, i),
        width: 2,
        points: { show: true, size: 6 },
        value: (u, v) => label(v, unit),
      }))),
    }, data, el);
    if (window.ResizeObserver) {
      new ResizeObserver(() => chart.plot.setSize({ width: Math.max(el.clientWidth, 240), height: HEIGHT })).observe(el);
    }
  }

  function drawIn(root) {
    if (root.matches && root.matches("[data-bench-chart]")) draw(root);
    if (root.querySelectorAll) root.querySelectorAll("[data-bench-chart]").forEach(draw);
  }

  drawIn(document);
  // A session swapped in by htmx (out of band, when a run ends) brings new, undrawn charts.
  document.addEventListener("htmx:load", (event) => drawIn(event.detail.elt));
})();
