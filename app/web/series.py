"""Chart data as JSON for every dashboard page: telemetry series and request-latency percentiles.

Both answer `{"t": [unix s...], "series": {label: [value or null...]}, "unit", "range", "resolution",
"step_s", "start_s", "end_s"}`, the shape static/hearth.js draws (`"sparse": true` when buckets may be empty: points
are drawn and gaps bridged). Ranges up to 1 h read the 1-second samples (1 h is
averaged into 10-second points), up to 48 h the 1-minute rollups, beyond the hourly ones: every
query is a range read on a (series_id, time) primary key, never a scan of the samples.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta

from flask import Blueprint, abort, current_app, jsonify, request
from sqlalchemy import select, text

from app.gateway.context import services
from app.store.models import TTFT_DELIVERED, Series
from app.telemetry.rollup import HOUR_S, MINUTE_S, resolution
from app.telemetry.sampler import METRICS
from app.web.auth import login_required

bp = Blueprint("series", __name__)

RANGES = {
    "5m": timedelta(minutes=5),
    "1h": timedelta(hours=1),
    "24h": timedelta(hours=24),
    "7d": timedelta(days=7),
}
# Seconds per point for raw samples: 1 h of 1-second points would be 3600 per line every refresh.
RAW_STEP_S = {"5m": 1, "1h": 10}
# Seconds per bucket of the latency percentiles (requests are sparse; a bucket needs a few).
LATENCY_STEP_S = {"5m": 10, "1h": 60, "24h": 900, "7d": 3 * HOUR_S}
LATENCY_METRICS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "queue": "queue_ms"}
# More lines than this make a chart unreadable; it also bounds the work of one request.
MAX_METRICS = 6


def parse_range(value: str | None) -> tuple[str, timedelta]:
    """The range name and its length; 400 naming the accepted values otherwise."""
    name = value or "5m"
    if name not in RANGES:
        abort(400, description=f"range must be one of {', '.join(RANGES)} (got {name!r})")
    return name, RANGES[name]


def source_label(source: str) -> str:
    """A short legend name: 'host', 'GPU 0', or the runner's model and node."""
    if source.startswith("gpu:"):
        return f"GPU {source[4:]}"
    if source.startswith("runner:"):
        model, _, node = source[7:].partition("@")
        return model if node in ("", "local") else f"{model} ({node})"
    return source


# What a line of a metric is called in a chart's legend beside other metrics: words, never the metric's name.
LEGEND_NAMES = {
    "gen_tok_s": "written", "prompt_tok_s": "computed", "prompt_cached_tok_s": "reused from the cache",
    "running": "being written", "waiting": "waiting", "kv_used_pct": "answers", "kv_cached_pct": "cached prompts",
    "queue_waiting": "waiting", "in_flight": "in flight", "spec_draft_tok_s": "checked", "spec_accepted_tok_s": "kept",
    "preemptions_s": "paused", "cpu_pct": "CPU", "ram_used_bytes": "RAM used", "ram_total_bytes": "RAM",
    "gpu_util_pct": "busy", "vram_used_bytes": "memory used", "vram_total_bytes": "memory", "gpu_temp_c": "temperature",
    "gpu_power_w": "power",
}


def legend_name(metric: str) -> str:
    """A metric's line name in a legend (its words; an unnamed metric's name with spaces)."""
    return LEGEND_NAMES.get(metric, metric.replace("_", " "))


def _align(lines: dict[str, dict[int, float]]) -> tuple[list[int], dict[str, list[float | None]]]:
    """One shared time axis; a series without a value at a time gets null (a gap in the chart)."""
    times = sorted({t for points in lines.values() for t in points})
    return times, {label: [points.get(t) for t in times] for label, points in lines.items()}


def _range_query(range_name: str, end_s: int) -> tuple[int, str, int, int, str]:
    """(start_s, table, step_s, first bucket, SQL of one series' points) for a range ending at end_s."""
    start_s = end_s - int(RANGES[range_name].total_seconds())
    table = resolution(datetime.fromtimestamp(start_s, UTC), datetime.fromtimestamp(end_s, UTC))
    if table == "samples":
        step = RAW_STEP_S[range_name]
        lo = start_s // step * step
        sql = (f"SELECT (at / {step}) * {step} AS t, avg(value) FROM samples"
               " WHERE series_id = :s AND at >= :lo AND at <= :hi GROUP BY t ORDER BY t")
    else:
        step = MINUTE_S if table == "rollups_1m" else HOUR_S
        # The bucket holding `start` covers part of the range: include it.
        lo = start_s // step * step
        sql = (f"SELECT bucket, sum / count FROM {table}"
               " WHERE series_id = :s AND bucket >= :lo AND bucket <= :hi ORDER BY bucket")
    return start_s, table, step, lo, sql


def read_series(session, metrics: list[str], range_name: str, end_s: int,
                source_prefix: str | None = None) -> dict:
    """Chart data of `metrics` from every source (or those starting with `source_prefix`) over the range."""
    start_s, table, step, lo, sql = _range_query(range_name, end_s)
    query = select(Series.id, Series.source, Series.metric).where(Series.metric.in_(metrics))
    if source_prefix:
        query = query.where(Series.source.startswith(source_prefix, autoescape=True))
    rows = sorted(session.execute(query), key=lambda r: (metrics.index(r.metric), r.source))
    lines: dict[str, dict[int, float]] = {}
    several_metrics = len({r.metric for r in rows}) > 1
    several_sources = len({r.source for r in rows}) > 1
    for series_id, source, metric in rows:
        # Name what tells the lines apart, in words: the model (or device), what the line counts, or both.
        if several_metrics and several_sources:
            label = f"{source_label(source)} · {legend_name(metric)}"
        elif several_metrics:
            label = legend_name(metric)
        else:
            label = source_label(source)
        lines[label] = {int(t): float(v) for t, v in session.execute(text(sql), {"s": series_id, "lo": lo, "hi": end_s})}
    t, series = _align(lines)
    units = {METRICS[m].unit for m in metrics if m in METRICS}
    return {"t": t, "series": series, "unit": units.pop() if len(units) == 1 else "",
            "range": range_name, "resolution": table, "step_s": step, "start_s": start_s, "end_s": end_s}


# Where the prompt tokens of admitted requests came from, bottom of the stack first (app/telemetry/sampler.py,
# prompt_parts): the four add up to the clients' prompt tokens.
PROMPT_PARTS = {
    "prompt_kv_tok_s": "KV cache",
    "prompt_ram_tok_s": "RAM tier",
    "prompt_disk_tok_s": "disk tier",
    "prompt_computed_tok_s": "computed",
}


def read_stacked(session, parts: dict[str, str], range_name: str, end_s: int) -> dict:
    """Chart data of a stack: one line per metric of `parts` (named by its label), summed over every runner.

    A point is the sum of the runners that have one then (null when none has); `"stacked": true` tells the chart
    to pile the lines up, in the order `"order"` lists them, with each part's own value in the legend."""
    start_s, table, step, lo, sql = _range_query(range_name, end_s)
    rows = session.execute(select(Series.id, Series.metric).where(Series.metric.in_(list(parts)),
                                                                   Series.source.startswith("runner:")))
    lines: dict[str, dict[int, float]] = {label: {} for label in parts.values()}
    for series_id, metric in rows:
        points = lines[parts[metric]]
        for t, v in session.execute(text(sql), {"s": series_id, "lo": lo, "hi": end_s}):
            points[int(t)] = points.get(int(t), 0.0) + float(v)
    if not any(lines.values()):
        lines = {}
    t, series = _align(lines)
    # JSON objects carry no order (jsonify sorts their keys): the stack's order travels beside them.
    return {"t": t, "series": series, "order": list(series), "unit": "tok/s", "stacked": True, "range": range_name, "resolution": table,
            "step_s": step, "start_s": start_s, "end_s": end_s}


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of an ascending list."""
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _stored(t: datetime) -> str:
    # requests.arrival_at is stored as naive UTC text ('YYYY-MM-DD HH:MM:SS[.ffffff]'): compare as text
    # so the (class_name, arrival_at) and arrival_at indexes serve the range.
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def read_latency(session, field: str, range_name: str, end_s: int,
                 quantiles: tuple[int, ...] = (50, 95)) -> dict:
    """Per class and time bucket, percentiles of a request field (ttft_ms, tpot_ms, queue_ms) of served requests."""
    step = LATENCY_STEP_S[range_name]
    start_s = end_s - int(RANGES[range_name].total_seconds())
    # Rows logged before migration 0010 measured another TTFT (first byte, runner's): not charted with it.
    ttft_only = f" AND coalesce(ttft_kind, '{TTFT_DELIVERED}') = '{TTFT_DELIVERED}'" if field == "ttft_ms" else ""
    rows = session.execute(
        text(f"SELECT CAST(strftime('%s', arrival_at) AS INTEGER) / {step} * {step}, class_name, {field}"
             " FROM requests WHERE arrival_at >= :lo AND arrival_at <= :hi AND status = 'ok'"
             f" AND {field} IS NOT NULL" + ttft_only),
        {"lo": _stored(datetime.fromtimestamp(start_s, UTC)), "hi": _stored(datetime.fromtimestamp(end_s, UTC))},
    )
    buckets: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for bucket, class_name, value in rows:
        buckets[class_name or "unknown"][int(bucket)].append(float(value))
    lines: dict[str, dict[int, float]] = {}
    for class_name in sorted(buckets):
        per_bucket = {b: sorted(v) for b, v in buckets[class_name].items()}
        for q in quantiles:
            lines[f"{class_name} p{q}"] = {b: percentile(v, q) for b, v in per_bucket.items()}
    t, series = _align(lines)
    return {"t": t, "series": series, "unit": "ms", "range": range_name, "resolution": "requests", "step_s": step,
            "sparse": True, "start_s": start_s, "end_s": end_s}


def _now_s() -> int:
    clock = current_app.config.get("HEARTH_CLOCK") or time.time
    return int(clock())


@bp.get("/api/series")
@login_required
def series_json():
    """`?metric=a,b&range=5m|1h|24h|7d[&source=prefix]`: telemetry series for a chart."""
    metrics = [m for m in request.args.get("metric", "").split(",") if m]
    if not metrics:
        abort(400, description=f"metric is required, one or more of: {', '.join(METRICS)}")
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        abort(400, description=f"unknown metric {', '.join(unknown)}; known: {', '.join(METRICS)}")
    if len(metrics) > MAX_METRICS:
        abort(400, description=f"at most {MAX_METRICS} metrics per chart")
    range_name, _ = parse_range(request.args.get("range"))
    with services().sessions() as session:
        return jsonify(read_series(session, metrics, range_name, _now_s(), request.args.get("source")))


@bp.get("/api/prompt_parts")
@login_required
def prompt_parts_json():
    """`?range=…`: prompt tokens/s of admitted requests by where they came from (KV cache, RAM tier, disk tier,
    computed), all runners together, stacked."""
    range_name, _ = parse_range(request.args.get("range"))
    with services().sessions() as session:
        return jsonify(read_stacked(session, PROMPT_PARTS, range_name, _now_s()))


@bp.get("/api/latency")
@login_required
def latency_json():
    """`?metric=ttft|tpot|queue&range=…`: p50 and p95 per class from the request log."""
    name = request.args.get("metric", "ttft")
    if name not in LATENCY_METRICS:
        abort(400, description=f"metric must be one of {', '.join(LATENCY_METRICS)} (got {name!r})")
    range_name, _ = parse_range(request.args.get("range"))
    with services().sessions() as session:
        return jsonify(read_latency(session, LATENCY_METRICS[name], range_name, _now_s()))
