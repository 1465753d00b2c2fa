/* Hearth dashboard helpers: live uPlot charts fed by JSON endpoints.

   Hearth.chart(el, url, options) draws the JSON {t: [unix s...], series: {name: [values...]}, unit,
   sparse, start_s, end_s} that `url` returns, refreshes it every options.interval ms (default
   2000; long ranges less often) without reloading the page, and pauses while the tab is hidden.
   Every element with data-chart-url gets one on load; buttons with data-range switch the time
   range of every chart on the page. Hearth.charts holds the chart objects (tests read their
   point counts). A chart inside a closed <details> fetches nothing until it is opened; sections
   (<details class="section" id=…>) are remembered open or closed in this browser. */
(function () {
  "use strict";

  const Hearth = (window.Hearth = window.Hearth || {});
  Hearth.charts = [];
  Hearth.range = null;

  // Long ranges change slowly (their points are minutes or hours wide): poll them less often.
  const REFRESH_MS = { "5m": 2000, "1h": 10000, "24h": 60000, "7d": 300000 };

  const PALETTE = ["#e8590c", "#1c7ed6", "#2b8a3e", "#ae3ec9", "#f59f00", "#0ca678", "#e64980", "#5c7cfa", "#868e96", "#74b816"];

  function cssVar(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  }

  /* A value with its unit, compact: bytes in binary units, percentages and rates with few digits. */
  function format(value, unit) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    if (unit === "B") {
      const units = ["B", "KiB", "MiB", "GiB", "TiB"];
      let v = value;
      let i = 0;
      while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
      return v.toFixed(v >= 100 || i === 0 ? 0 : 1) + " " + units[i];
    }
    const abs = Math.abs(value);
    const digits = abs >= 100 ? 0 : abs >= 10 ? 1 : 2;
    const text = value.toFixed(digits);
    return unit ? text + " " + unit : text;
  }
  Hearth.format = format;

  function withRange(url, range) {
    const u = new URL(url, window.location.href);
    if (range && !u.searchParams.has("fixed_range")) u.searchParams.set("range", range);
    return u.pathname + u.search;
  }

  class Chart {
    constructor(el, url, options) {
      this.el = el;
      this.url = url;
      this.options = options || {};
      this.unit = this.options.unit !== undefined ? this.options.unit : el.dataset.unit || "";
      this.height = Number(this.options.height || el.dataset.height || 180);
      this.emptyText = this.options.empty || el.dataset.empty || "No data yet.";
      this.plot = null;
      this.sparse = false;
      this.span = null;
      this.names = [];
      this.data = [[]];
      this.inFlight = false;
      this.last = 0;
      this.overlay = document.createElement("div");
      this.overlay.className = "chart-empty";
      this.overlay.textContent = "Loading…";
      el.appendChild(this.overlay);
      if (window.ResizeObserver) {
        new ResizeObserver(() => this.resize()).observe(el);
      }
    }

    /* Values drawn (non-null), all series together. */
    points() {
      let n = 0;
      for (let i = 1; i < this.data.length; i += 1) {
        for (const v of this.data[i]) if (v !== null && v !== undefined) n += 1;
      }
      return n;
    }

    resize() {
      if (this.plot && this.el.clientWidth > 0) {
        this.plot.setSize({ width: this.el.clientWidth, height: this.height });
      }
    }

    message(text) {
      this.overlay.textContent = text;
      this.overlay.hidden = !text;
    }

    /* Refresh when this chart's range is due (every tick for 5 min, less often for long ranges). */
    tick() {
      const range = this.options.range || Hearth.range;
      if (Date.now() - this.last >= (REFRESH_MS[range] || 2000) - 100) this.refresh();
    }

    async refresh() {
      // A chart in a closed section fetches nothing: opening it refreshes it (see the toggle handler below).
      if (document.hidden || this.inFlight || !Hearth.shown(this.el)) return;
      this.inFlight = true;
      this.last = Date.now();
      try {
        const response = await fetch(withRange(this.url, this.options.range || Hearth.range), {
          headers: { Accept: "application/json" },
          credentials: "same-origin",
        });
        if (response.status === 401) {
          window.location.href = "/login?next=" + encodeURIComponent(window.location.pathname);
          return;
        }
        if (!response.ok) {
          this.message("Chart data unavailable (HTTP " + response.status + "); retrying.");
          return;
        }
        this.render(await response.json());
      } catch (error) {
        // hearth serve restarting or the network gone: say so on the chart and keep polling.
        this.message("Cannot reach Hearth; retrying.");
      } finally {
        this.inFlight = false;
      }
    }

    render(json) {
      if (json.unit !== undefined) this.unit = json.unit;
      // The x axis spans the requested window, so every chart on a page lines up in time.
      this.span = json.start_s !== undefined ? [json.start_s, json.end_s] : null;
      const sparse = Boolean(json.sparse);
      if (sparse !== this.sparse) {
        this.sparse = sparse;
        this.names = [];
      }
      let names = json.order || Object.keys(json.series || {});
      let data = [json.t || []].concat(names.map((name) => json.series[name]));
      this.data = data;
      this.stacked = Boolean(json.stacked);
      if (this.stacked) [names, data] = stack(names, data);
      if (!this.plot || names.join("\u0000") !== this.names.join("\u0000")) {
        this.build(names, data);
      } else {
        this.plot.setData(data);
      }
      this.message(this.points() > 0 ? "" : this.emptyText);
    }

    /* A stacked chart's part at a point: series `si` as drawn (top of the stack first) back to its own value. */
    partValue(si, idx) {
      const part = this.data.length - si; // drawn series si is the part at this index of this.data
      const v = this.data[part] ? this.data[part][idx] : null;
      return v === undefined ? null : v;
    }

    build(names, data) {
      if (this.plot) this.plot.destroy();
      this.names = names;
      const unit = () => this.unit;
      const axis = cssVar("--muted") || "#888";
      const grid = cssVar("--grid") || "rgba(0,0,0,0.07)";
      const colors = this.options.colors || {};
      const opts = {
        width: Math.max(this.el.clientWidth, 200),
        height: this.height,
        cursor: { drag: { x: false, y: false } },
        legend: { live: true },
        scales: { x: { time: true, range: (u, min, max) => this.span || [min, max] }, y: { range: (u, min, max) => [Math.min(0, min || 0), max > 0 ? max * 1.1 : 1] } },
        axes: [
          { stroke: axis, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid } },
          {
            stroke: axis,
            grid: { stroke: grid, width: 1 },
            ticks: { stroke: grid },
            // Wide enough for the longest tick label ("1.5 GiB", "1000 ms"): a fixed size clips them.
            size: (u, values) => {
              const longest = Math.max(4, ...(values || []).map((v) => String(v).length));
              return Math.ceil(longest * 7 + 18);
            },
            values: (u, splits) => splits.map((v) => format(v, unit())),
          },
        ],
        series: [{}].concat(
          names.map((name, i) => ({
            label: name,
            stroke: colors[name] || PALETTE[(this.stacked ? names.length - 1 - i : i) % PALETTE.length],
            width: 1.5,
            // Sparse series (request percentiles per bucket) draw their points and bridge empty buckets.
            spanGaps: this.sparse,
            points: this.sparse ? { show: true, size: 5 } : { show: false },
            // A stack's legend gives each part's own value, not the running sum it is drawn at.
            value: (u, v, si, idx) => format(this.stacked && idx !== null && idx !== undefined ? this.partValue(si, idx) : v, unit()),
            fill: this.stacked ? (colors[name] || PALETTE[(names.length - 1 - i) % PALETTE.length]) + "66" : undefined,
          }))
        ),
      };
      this.plot = new window.uPlot(opts, data, this.el);
      this.el.appendChild(this.overlay);
    }
  }

  /* A stack: each part drawn at the sum of itself and the parts before it, the top of the stack first (uPlot
     fills each line down to zero, so the later, lower ones stay visible). A point where no part has a value
     stays a gap; where some have, the missing ones count as 0. */
  function stack(names, data) {
    const sums = [];
    const running = data[0].map(() => null);
    for (let i = 1; i < data.length; i += 1) {
      for (let j = 0; j < running.length; j += 1) {
        const v = data[i][j];
        if (v !== null && v !== undefined) running[j] = (running[j] || 0) + v;
      }
      sums.push(running.slice());
    }
    const any = data[0].map((_, j) => data.slice(1).some((d) => d[j] !== null && d[j] !== undefined));
    const filled = sums.map((line) => line.map((v, j) => (any[j] ? v || 0 : null)));
    return [names.slice().reverse(), [data[0]].concat(filled.reverse())];
  }
  Hearth.stack = stack;

  /* A live chart in `el` from `url`; returns the chart object (also kept in Hearth.charts). */
  Hearth.chart = function (el, url, options) {
    const chart = new Chart(el, url, options);
    Hearth.charts.push(chart);
    const interval = (options && options.interval) || 2000;
    chart.refresh();
    chart.timer = window.setInterval(() => chart.tick(), interval);
    return chart;
  };

  /* Whether `el` is on show: not inside a closed <details> section. */
  Hearth.shown = function (el) {
    return !el.closest("details:not([open])");
  };

  /* Sections (<details id=…>) stay as the admin left them, in this browser; opening one refreshes its charts. */
  const OPEN_KEY = "hearth:open:";
  function remember(details) {
    try {
      window.localStorage.setItem(OPEN_KEY + details.id, details.open ? "1" : "0");
    } catch (error) {
      // Storage off (private mode): the section simply starts closed next time.
    }
  }
  function restoreSections() {
    document.querySelectorAll("details.section[id]").forEach((d) => {
      let saved = null;
      try {
        saved = window.localStorage.getItem(OPEN_KEY + d.id);
      } catch (error) {
        saved = null;
      }
      if (saved === "1") d.open = true;
      d.addEventListener("toggle", () => {
        remember(d);
        if (d.open) Hearth.charts.filter((c) => d.contains(c.el)).forEach((c) => { c.resize(); c.refresh(); });
      });
    });
  }

  /* Switch every chart (and the range buttons) to `range`, remembered in the address bar. */
  Hearth.setRange = function (range) {
    Hearth.range = range;
    document.querySelectorAll("[data-range]").forEach((b) => {
      const on = b.dataset.range === range;
      b.classList.toggle("active", on);
      b.setAttribute("aria-pressed", on ? "true" : "false");
    });
    const u = new URL(window.location.href);
    u.searchParams.set("range", range);
    window.history.replaceState(null, "", u.pathname + u.search);
    Hearth.charts.forEach((c) => c.refresh());
    document.dispatchEvent(new CustomEvent("hearth:range", { detail: { range: range } }));
  };

  /* When a poll cannot reach hearth serve, say so (on /status: the health line turns red) until a
     request gets through again. */
  function setOffline(offline) {
    document.body.classList.toggle("offline", offline);
    const health = document.querySelector(".status-health");
    if (health && offline) {
      health.className = "status-health status-bad";
      health.querySelector(".status-health-text").textContent = "Down: Hearth is not answering";
    }
  }
  document.addEventListener("htmx:sendError", () => setOffline(true));
  document.addEventListener("htmx:afterRequest", (e) => {
    if (e.detail && e.detail.successful) setOffline(false);
  });

  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) Hearth.charts.forEach((c) => c.refresh());
  });

  function init() {
    restoreSections();
    const active = document.querySelector("[data-range].active");
    Hearth.range = new URL(window.location.href).searchParams.get("range") || (active && active.dataset.range) || "5m";
    document.querySelectorAll("[data-range]").forEach((b) => {
      const on = b.dataset.range === Hearth.range;
      b.classList.toggle("active", on);
      b.setAttribute("aria-pressed", on ? "true" : "false");
      b.addEventListener("click", () => Hearth.setRange(b.dataset.range));
    });
    if (!window.uPlot) return;
    document.querySelectorAll("[data-chart-url]").forEach((el) => {
      Hearth.chart(el, el.dataset.chartUrl, { interval: Number(el.dataset.interval || 2000) });
    });
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", init);
  } else {
    init();
  }
})();
