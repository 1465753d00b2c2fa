"""`hearth bench history`: the dashboard against a store holding days of synthetic history.

Targets (issue: live dashboard), with 7 days of 1-second samples for 2 runners and 100k request
rows in the store: overview page ≤ 50 ms server time, chart data for 24 h ≤ 100 ms, and the store
for 30 days of samples and 100k requests ≤ 300 MB.

Two stores are built with the real schema (app.store.db.open_store, all migrations) and
the real rollup code (app.telemetry.rollup.rollup, run once per simulated day as the job would):

- the *timing* store: `--days` days of 1-second samples of every series, their 1-minute and
  1-hour rollups, `--requests` request rows spread over the days; pages are timed on it through a
  Flask test client logged in as the admin (server time: the WSGI call, no network);
- the *size* store: 30 days as `hearth serve` keeps them under the retention setting
  (`samples_retention_h`, default 48 h of 1-second samples; 1-minute rows for 30 days; hourly
  rows), plus the same request rows. Minute rows older than the sample window are written from
  the same synthetic seconds aggregated in memory (min, max, sum, count: what rollup() would
  write), because the seconds themselves would have been pruned. Its size is measured on disk.
  The timing store's size is printed too: that is what keeping 7 days of seconds costs.

The values follow a household's day: idle most of the time, bursts of requests in the morning
and evening; zeros are cheap in SQLite (a REAL 0 is stored in no bytes), so the busy share
(`--busy`) is printed as one of the constants.
"""

from __future__ import annotations

import json
import math
import random
import re
import sqlite3
import statistics
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import func, insert, select
from sqlalchemy import table as sa_table
from tqdm import tqdm

from app.gateway.tokens import create_token
from app.hardware import cpu_model, usable_cores
from app.store.db import open_store
from app.store.models import RequestRecord, ResidencyEvent, Series
from app.telemetry.rollup import GRACE_S, rollup

DAY_S = 86_400
MINUTE_S = 60
RUNNER_METRICS = ("gen_tok_s", "prompt_tok_s", "running", "waiting", "kv_used_pct", "preemptions_s", "slots_busy")
HOST_METRICS = ("cpu_pct", "ram_used_bytes", "ram_total_bytes")
GPU_METRICS = ("gpu_util_pct", "vram_used_bytes", "vram_total_bytes", "gpu_temp_c", "gpu_power_w")
MODEL_NAMES = ("gemma-3-270m-q4_k_m", "qwen2.5-1.5b-instruct-q4_k_m", "llama-3.2-3b-instruct-q4_k_m",
               "phi-3.5-mini-instruct-q4_k_m")
MEMBERS = (("alice", 0.30), ("bob", 0.25), ("carol", 0.20), ("kitchen-speaker", 0.15), ("coding-plugin", 0.095),
           ("guest", 0.005))
CLASSES = (("voice", 0.25), ("chat", 0.35), ("coding", 0.15), ("documents", 0.10), ("background", 0.15))
STATUSES = (("ok", 0.96), ("error", 0.015), ("timeout", 0.01), ("rejected", 0.01), ("cancelled", 0.005))
# Seeds the synthetic seconds after the built history (day numbers of the history start at 0).
TOP_UP_DAY = 1_000_000
TARGETS = {"overview_ms": 50.0, "chart_24h_ms": 100.0, "store_30d_mb": 300.0}


@dataclass
class HistoryConfig:
    """What the synthetic history holds; every field is printed as a constant of the run."""

    days: float = 7
    size_days: float = 30
    runners: int = 2
    gpus: int = 1
    requests: int = 100_000
    busy: float = 0.15
    retention_h: float = 48.0
    seed: int = 1
    end: datetime = field(default_factory=lambda: datetime.now(UTC).replace(second=0, microsecond=0))


def series_keys(cfg: HistoryConfig) -> list[tuple[str, str]]:
    """(source, metric) of every series a box with these runners and GPUs records."""
    keys = [("host", m) for m in HOST_METRICS]
    keys += [(f"gpu:{i}", m) for i in range(cfg.gpus) for m in GPU_METRICS]
    keys += [(f"runner:{MODEL_NAMES[i % len(MODEL_NAMES)]}@local", m) for i in range(cfg.runners) for m in RUNNER_METRICS]
    return keys


def _activity(rng: np.random.Generator, t0: int, busy: float) -> np.ndarray:
    """0/1 per second of one day: bursts of activity, more in the morning and evening, `busy` overall."""
    hours = ((np.arange(DAY_S) + t0) % DAY_S) / 3600.0
    # Two humps (07-09 and 18-22 h) over a low base; scaled so the day's mean is `busy`.
    shape = 0.2 + np.exp(-((hours - 8) ** 2) / 2) + 1.5 * np.exp(-((hours - 20) ** 2) / 4)
    p = np.clip(shape / shape.mean() * busy, 0, 1)
    # Requests last tens of seconds: decide per 20-second block, not per second.
    blocks = rng.random(DAY_S // 20) < p[::20]
    return np.repeat(blocks, 20).astype(np.float64)


def day_values(cfg: HistoryConfig, key: tuple[str, str], day: int, t0: int) -> np.ndarray:
    """The 86,400 one-second values of one series on one day (deterministic per seed, series, day)."""
    source, metric = key
    rng = np.random.default_rng([cfg.seed, day, zlib.crc32(f"{source}/{metric}".encode())])
    # Seeded by source only: a runner's metrics rise and fall together.
    active = _activity(np.random.default_rng([cfg.seed, day, zlib.crc32(source.encode())]), t0, cfg.busy)
    noise = rng.random(DAY_S)
    if metric == "cpu_pct":
        return np.round(3 + 2 * noise + active * (60 + 30 * noise), 1)
    if metric == "ram_total_bytes":
        return np.full(DAY_S, 16 * 2**30, dtype=np.float64)
    if metric == "ram_used_bytes":
        return np.round(5.2e9 + 0.3e9 * active + 4e6 * noise)
    if metric == "vram_total_bytes":
        return np.full(DAY_S, 12 * 2**30, dtype=np.float64)
    if metric == "vram_used_bytes":
        return np.round(3.1e9 + 0.4e9 * active + 1e6 * noise)
    if metric == "gpu_util_pct":
        return np.round(active * (55 + 40 * noise))
    if metric == "gpu_temp_c":
        return np.round(38 + 25 * active + 2 * noise)
    if metric == "gpu_power_w":
        return np.round(18 + 140 * active + 8 * noise, 1)
    if metric == "gen_tok_s":
        return np.round(active * (40 + 160 * noise), 1)
    if metric == "prompt_tok_s":
        return np.round(active * np.where(noise > 0.8, 900 * noise, 0), 1)
    if metric in ("running", "slots_busy"):
        return active * np.floor(1 + 4 * noise)
    if metric == "waiting":
        return active * np.floor(np.maximum(0, 6 * noise - 4))
    if metric == "kv_used_pct":
        return np.round(active * (5 + 70 * noise), 1)
    if metric == "preemptions_s":
        return active * (noise > 0.995)
    raise ValueError(f"no synthetic pattern for {metric}")


def _minute_rows(series_id: int, t0: int, values: np.ndarray) -> list[tuple]:
    """What rollup() writes for one day of one series: (series_id, bucket, min, max, sum, count) per minute."""
    m = values.reshape(-1, MINUTE_S)
    buckets = t0 + MINUTE_S * np.arange(m.shape[0])
    return list(zip([series_id] * m.shape[0], buckets.tolist(), m.min(1).tolist(), m.max(1).tolist(),
                    m.sum(1).tolist(), [MINUTE_S] * m.shape[0], strict=True))


def _request_rows(cfg: HistoryConfig, start: datetime, n: int) -> list[dict]:
    """`n` request rows spread over [start, end) with the household's daily rhythm."""
    rng = random.Random(cfg.seed)
    span_s = (cfg.end - start).total_seconds()
    models = [MODEL_NAMES[i % len(MODEL_NAMES)] for i in range(max(1, cfg.runners))]
    rows = []
    while len(rows) < n:
        offset = rng.random() * span_s
        at = start + timedelta(seconds=offset)
        # Rejection sampling against the same two-hump day as the samples.
        h = at.hour + at.minute / 60
        if rng.random() * 2.7 > 0.2 + math.exp(-((h - 8) ** 2) / 2) + 1.5 * math.exp(-((h - 20) ** 2) / 4):
            continue
        klass = rng.choices([c for c, _ in CLASSES], [w for _, w in CLASSES])[0]
        status = rng.choices([s for s, _ in STATUSES], [w for _, w in STATUSES])[0]
        ok = status == "ok"
        prompt = int(rng.lognormvariate(5 if klass != "documents" else 7.5, 0.6))
        completion = int(rng.lognormvariate(4 if klass == "voice" else 5.2, 0.7)) if ok else 0
        ttft = rng.lognormvariate(5.5 if klass == "voice" else 6.3, 0.6) if status in ("ok", "cancelled") else None
        tpot = rng.lognormvariate(3.4, 0.35) if ok and completion > 1 else None
        queue = rng.expovariate(1 / 40) if status != "rejected" else None
        rows.append({
            "arrival_at": at,
            "member_name": rng.choices([m for m, _ in MEMBERS], [w for _, w in MEMBERS])[0],
            "token_id": None,
            "class_name": klass,
            "model": rng.choice(models) if status != "rejected" else None,
            "runner": "local" if status != "rejected" else None,
            "stream": rng.random() < 0.7,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "queue_ms": queue,
            "ttft_ms": ttft,
            "tpot_ms": tpot,
            "total_ms": (ttft or 0) + (tpot or 0) * completion if ok else None,
            "num_preemptions": 1 if ok and rng.random() < 0.01 else 0,
            "queue_position": 0,
            "status": status,
            "http_status": {"ok": 200, "error": 502, "timeout": 503, "rejected": 429, "cancelled": 499}[status],
            "error": None if ok else f"synthetic {status}",
        })
    return rows


def _insert_samples(conn: sqlite3.Connection, series_id: int, t0: int, values: np.ndarray) -> int:
    at = np.arange(t0, t0 + len(values))
    conn.executemany("INSERT INTO samples (series_id, at, value) VALUES (?,?,?)",
                     zip([series_id] * len(values), at.tolist(), values.tolist(), strict=True))
    return len(values)


def top_up(data: Path, cfg: HistoryConfig, until: datetime) -> int:
    """Samples from the end of the built history up to `until` (the build took minutes), rolled up: the
    pages are timed against a store that is current, as a live one is."""
    engine, sessions = open_store(data)
    end_s = int(cfg.end.timestamp()) // MINUTE_S * MINUTE_S
    n = max(0, int(until.timestamp()) - end_s)
    conn = _raw(engine)
    with sessions() as s:
        ids = {(r.source, r.metric): r.id for r in s.scalars(select(Series))}
    written = 0
    if n:
        for key, sid in ids.items():
            written += _insert_samples(conn, sid, end_s, day_values(cfg, key, TOP_UP_DAY, end_s)[:min(n, DAY_S)])
        conn.commit()
        with sessions() as s:
            rollup(s, until)
            s.commit()
    conn.close()
    engine.dispose()
    return written


def _raw(engine) -> sqlite3.Connection:
    return engine.raw_connection().driver_connection


def build_store(data: Path, cfg: HistoryConfig, sample_days: float, history_days: float,
                progress: bool = True) -> dict[str, Any]:
    """Build a store with `history_days` of telemetry ending at cfg.end, of which the last `sample_days`
    keep their 1-second samples (older days: minute rows only), plus cfg.requests request rows."""
    t_build = time.perf_counter()
    engine, sessions = open_store(data)
    keys = series_keys(cfg)
    end_s = int(cfg.end.timestamp()) // MINUTE_S * MINUTE_S
    first_day_s = end_s - int(history_days * DAY_S) // MINUTE_S * MINUTE_S
    raw_from_s = end_s - int(sample_days * DAY_S) // MINUTE_S * MINUTE_S
    with sessions() as s:
        ids = {}
        for source, metric in keys:
            ids[(source, metric)] = s.execute(insert(Series).values(source=source, metric=metric).returning(Series.id)).scalar_one()
        s.commit()
    counts = {"samples": 0, "rollups_1m_direct": 0}
    conn = _raw(engine)
    n_days = math.ceil((end_s - first_day_s) / DAY_S)
    bar = tqdm(total=n_days * len(keys), desc="samples (series × days)", unit="series-day", disable=not progress)
    for day in range(n_days):
        t0 = first_day_s + day * DAY_S
        length = min(DAY_S, end_s - t0)  # the last day may be partial
        for key in keys:
            values = day_values(cfg, key, day, t0)[:length]
            sid = ids[key]
            # Seconds before raw_from_s were pruned long ago: only their minute rows remain.
            split = min(length, max(0, raw_from_s - t0))
            if split:
                rows = _minute_rows(sid, t0, values[:split])
                conn.executemany("INSERT INTO rollups_1m (series_id, bucket, min, max, sum, count) VALUES (?,?,?,?,?,?)", rows)
                counts["rollups_1m_direct"] += len(rows)
            if split < length:
                counts["samples"] += _insert_samples(conn, sid, t0 + split, values[split:])
            conn.commit()
            bar.update(1)
        if t0 + length > raw_from_s:
            # The rollup job, once the day is over (it runs every minute in hearth serve).
            with sessions() as s:
                rollup(s, datetime.fromtimestamp(t0 + length + GRACE_S, UTC))
                s.commit()
    bar.close()
    with sessions() as s:
        written = rollup(s, datetime.fromtimestamp(end_s + GRACE_S, UTC))
        s.commit()
    start = datetime.fromtimestamp(first_day_s, UTC)
    rows = _request_rows(cfg, start, cfg.requests)
    chunk = 5000
    with sessions() as s:
        for i in tqdm(range(0, len(rows), chunk), desc="requests", unit="chunk", disable=not progress):
            s.execute(insert(RequestRecord), rows[i:i + chunk])
            s.commit()
        for member, _ in MEMBERS:
            klass = "voice" if member == "kitchen-speaker" else "chat"
            create_token(s, member, klass, ["chat", "coding"])
        _residency_history(s, cfg, start)
        s.commit()
    with sessions() as s:
        table_rows = {t: s.execute(select(_count(t))).scalar_one() for t in ("samples", "rollups_1m", "rollups_1h", "requests")}
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    engine.dispose()
    return {"rows": table_rows, "build_s": time.perf_counter() - t_build, "final_rollup": written,
            "bytes": store_bytes(data), "tables_bytes": table_bytes(data)}


def _count(table: str):
    return select(func.count()).select_from(sa_table(table)).scalar_subquery()


def _residency_history(s, cfg: HistoryConfig, start: datetime) -> None:
    """A load, keep-alive unload and the odd eviction per model per day, so the Models page has history."""
    rng = random.Random(cfg.seed + 1)
    at = start
    while at < cfg.end:
        for i in range(cfg.runners):
            name = MODEL_NAMES[i % len(MODEL_NAMES)]
            load_at = at + timedelta(hours=7, minutes=rng.randint(0, 50))
            s.add(ResidencyEvent(at=load_at, model_name=name, node="local", event="load", reason="first request",
                                 cold_start_ms=rng.uniform(900, 2500), estimate_bytes=420 * 2**20,
                                 measured_bytes=int(rng.uniform(380, 440) * 2**20), pid=1000 + i))
            kind = "evict" if rng.random() < 0.2 else "unload"
            s.add(ResidencyEvent(at=load_at + timedelta(hours=rng.uniform(1, 14)), model_name=name, node="local",
                                 event=kind, reason="idle 300 s, keep-alive 300 s" if kind == "unload" else "evicted",
                                 estimate_bytes=420 * 2**20, measured_bytes=410 * 2**20, pid=1000 + i))
        at += timedelta(days=1)


def store_bytes(data: Path) -> int:
    """Bytes of the store on disk: the database file plus its WAL and shared-memory files."""
    return sum(p.stat().st_size for p in data.glob("hearth.db*") if p.is_file())


def table_bytes(data: Path) -> dict[str, int] | None:
    """Bytes per table and index from SQLite's dbstat (None when this SQLite lacks it)."""
    try:
        with sqlite3.connect(data / "hearth.db") as db:
            rows = db.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name ORDER BY 2 DESC").fetchall()
    except sqlite3.OperationalError:
        return None
    return {name: int(size) for name, size in rows}


# -- timing the pages ------------------------------------------------------------------------------------


def make_client(data: Path, default_model: str):
    """A test client of the real app on `data`, logged in as the admin (no scheduler, no runner started)."""
    from werkzeug.security import generate_password_hash

    from app.factory import create_app
    from app.secrets import write_secret

    password = "bench-password"
    write_secret(data, "admin_password", generate_password_hash(password))
    app = create_app({"HEARTH_DATA": str(data), "HEARTH_DEFAULT_MODEL": default_model,
                      "HEARTH_MODELS_DIR": str(data / "models"), "SCHEDULER": False, "TESTING": True,
                      "WTF_CSRF_ENABLED": False, "RATELIMIT_ENABLED": False})
    client = app.test_client()
    r = client.post("/login", data={"password": password})
    if r.status_code != 302:
        raise RuntimeError(f"bench login failed: HTTP {r.status_code}")
    return app, client


def page_urls(app, client) -> list[tuple[str, str]]:
    """(label, URL) of every page timed: the overview and its charts' data for 24 h, then ours."""
    urls = []
    if any(r.rule == "/" for r in app.url_map.iter_rules()):
        urls.append(("overview", "/"))
        urls += overview_chart_urls(client.get("/").get_data(as_text=True), "24h")
    urls += [
        ("models", "/models"),
        ("classes 24 h", "/classes?range=24h"),
        ("classes 7 d", "/classes?range=7d"),
        ("requests", "/requests"),
        ("requests member=alice", "/requests?member=alice"),
        ("requests member=guest (rare)", "/requests?member=guest"),
        ("requests status=cancelled", "/requests?status=cancelled"),
        ("requests class+24 h", "/requests?class=voice&range=24h"),
        ("members", "/members"),
    ]
    return urls


_CHART = re.compile(r'id="([^"]+)" data-chart-url="([^"]+)"')


def overview_chart_urls(html: str, range_name: str) -> list[tuple[str, str]]:
    """("chart <id>", URL) of every chart on the overview page, with the range its picker would set."""
    out = []
    for chart_id, url in _CHART.findall(html):
        url = url.replace("&amp;", "&")
        out.append((f"chart {chart_id} {range_name}", f"{url}{'&' if '?' in url else '?'}range={range_name}"))
    return out


def time_get(client, url: str, n: int) -> dict[str, Any]:
    """Median, min and max of `n` GETs (after one warm-up), in ms, with the status code."""
    r = client.get(url)
    status = r.status_code
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.get(url)
        times.append((time.perf_counter() - t0) * 1000)
        status = r.status_code
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "n": n,
            "status": status, "bytes": len(r.data)}


def next_page_url(client) -> str | None:
    """The 'older' link of the first request page (a keyset cursor), to time page 2."""
    body = client.get("/requests").get_data(as_text=True)
    marker = "before="
    i = body.find(marker)
    if i < 0:
        return None
    j = i + len(marker)
    k = j
    while k < len(body) and (body[k].isdigit() or body[k] == "-"):
        k += 1
    return "/requests?before=" + body[j:k]


def machine() -> str:
    """CPU model, cores and SQLite version of this machine."""
    return f"{cpu_model() or 'unknown CPU'}, {usable_cores()} cores, SQLite {sqlite3.sqlite_version}"


def run_history(args, default_model: str) -> int:
    """Build both stores, time the pages, print and optionally write the figures."""
    cfg = HistoryConfig(days=args.days, size_days=args.size_days, runners=args.runners, gpus=args.gpus, requests=args.requests,
                        busy=args.busy, retention_h=args.retention_h, seed=args.seed)
    keys = series_keys(cfg)
    print(f"held constant: {cfg.days:g} days of 1-second samples, {len(keys)} series ({cfg.runners} runners × "
          f"{len(RUNNER_METRICS)}, {cfg.gpus} GPU × {len(GPU_METRICS)}, host × {len(HOST_METRICS)}), "
          f"{cfg.requests} requests, busy share {cfg.busy:.0%}, seed {cfg.seed}; "
          f"size store: {cfg.size_days:g} days with {cfg.retention_h:g} h of seconds; "
          f"{args.repeat} timed GETs per page (median); machine: {machine()}")
    out: dict[str, Any] = {"constants": {**asdict(cfg), "end": cfg.end.isoformat(), "series": len(keys),
                                         "repeat": args.repeat, "machine": machine()}}
    keep = Path(args.data) if args.data else None
    with tempfile.TemporaryDirectory(prefix="hearth-history-") as tmp:
        timing_dir = (keep or Path(tmp)) / "timing"
        size_dir = (keep or Path(tmp)) / "size"
        for d in (timing_dir, size_dir):
            if (d / "hearth.db").exists():
                raise SystemExit(f"{d} already holds a store; choose an empty --data folder")
        timing = build_store(timing_dir, cfg, sample_days=cfg.days, history_days=cfg.days, progress=not args.quiet)
        out["timing_store"] = timing
        print(f"timing store: {timing['rows']} built in {timing['build_s']:.0f} s, "
              f"{timing['bytes'] / 1e6:.1f} MB on disk ({cfg.days:g} days of seconds kept)")
        per_sample = (timing["tables_bytes"] or {}).get("samples", 0) / max(1, timing["rows"]["samples"])
        if per_sample:
            out["timing_store"]["bytes_per_sample"] = per_sample
            print(f"  samples table: {per_sample:.1f} bytes per 1-second sample (dbstat)")
        if not args.skip_size:
            size = build_store(size_dir, cfg, sample_days=cfg.retention_h / 24, history_days=cfg.size_days,
                               progress=not args.quiet)
            out["size_store"] = size
            print(f"size store: {size['rows']} built in {size['build_s']:.0f} s, {size['bytes'] / 1e6:.1f} MB on disk "
                  f"(target ≤ {TARGETS['store_30d_mb']:g} MB)")
            if size["tables_bytes"]:
                top = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in list(size["tables_bytes"].items())[:6])
                print(f"  largest: {top}")
        top_up(timing_dir, cfg, datetime.now(UTC))
        app, client = make_client(timing_dir, default_model)
        urls = page_urls(app, client)
        page2 = next_page_url(client)
        if page2:
            urls.append(("requests page 2 (keyset)", page2))
        pages = {}
        for label, url in urls:
            pages[label] = {"url": url, **time_get(client, url, args.repeat)}
            p = pages[label]
            print(f"  {label:<32} {p['median_ms']:7.1f} ms median  (min {p['min_ms']:.1f}, max {p['max_ms']:.1f}; "
                  f"HTTP {p['status']}, {p['bytes'] / 1024:.0f} KiB)  {url}")
        out["pages"] = pages
        from app.factory import shutdown_app

        shutdown_app(app)
    verdict = []
    if "overview" in pages:
        verdict.append(f"overview {pages['overview']['median_ms']:.1f} ms (target ≤ {TARGETS['overview_ms']:g})")
    charts = [p for k, p in pages.items() if k.startswith("chart")]
    if charts:
        worst = max(p["median_ms"] for p in charts)
        verdict.append(f"24 h chart data {worst:.1f} ms worst endpoint (target ≤ {TARGETS['chart_24h_ms']:g})")
    else:
        verdict.append("24 h chart data: no overview chart endpoint found to time")
    if "size_store" in out:
        verdict.append(f"30-day store {out['size_store']['bytes'] / 1e6:.1f} MB (target ≤ {TARGETS['store_30d_mb']:g})")
    print("; ".join(verdict))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {args.json_path}")
    return 0
