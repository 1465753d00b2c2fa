"""How often the household's requests really overlap, from the request log, and what residency to do about it.

A request is active from its arrival to its end (arrival + total_ms). Over a window the
concurrency histogram gives the share of time with 0, 1, 2–3, 4–7 and 8+ requests active, overall
and per class (the overall concurrency a class's requests met while they were active). Residency
advice comes from the same window: requests per model, and the cold starts paid for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.store.models import Model, RequestRecord, ResidencyEvent

# (label, lowest count in the bucket); a bucket runs up to the next one's lowest count.
BUCKETS: tuple[tuple[str, int], ...] = (("0", 0), ("1", 1), ("2", 2), ("4", 4), ("8+", 8))
WEEK_S = 7 * 24 * 3600
TYPICAL_QUANTILE = 0.9  # the overlap the household meets in 90 % of its busy time
LOAD_EVENTS = ("load", "restart")


@dataclass(frozen=True)
class Interval:
    """One request's active time, in Unix seconds."""

    start_s: float
    end_s: float
    class_name: str


def bucket_of(count: int) -> str:
    """The histogram bucket label of a concurrency count."""
    label = BUCKETS[0][0]
    for name, low in BUCKETS:
        if count >= low:
            label = name
    return label


def _segments(intervals: list[Interval], start_s: float, end_s: float) -> Iterable[tuple[float, dict[str, int]]]:
    """(duration, active count per class) for each stretch of the window where nothing changes."""
    events: list[tuple[float, int, str]] = []
    for iv in intervals:
        a, b = max(iv.start_s, start_s), min(iv.end_s, end_s)
        if b > a:
            events.append((a, 1, iv.class_name))
            events.append((b, -1, iv.class_name))
    # Ends before starts at the same instant: back-to-back requests do not overlap.
    events.sort(key=lambda e: (e[0], e[1]))
    active: dict[str, int] = {}
    t = start_s
    for at, delta, name in events:
        if at > t:
            yield at - t, dict(active)
            t = at
        active[name] = active.get(name, 0) + delta
        if active[name] == 0:
            del active[name]
    if end_s > t:
        yield end_s - t, dict(active)


def histogram(intervals: list[Interval], start_s: float, end_s: float) -> dict:
    """Share of the window per concurrency bucket, overall and per class; typical overlap while busy."""
    window_s = max(0.0, end_s - start_s)
    overall = {name: 0.0 for name, _ in BUCKETS}
    per_class: dict[str, dict[str, float]] = {}
    class_busy: dict[str, float] = {}
    by_count: dict[int, float] = {}
    for dur, active in _segments(intervals, start_s, end_s):
        n = sum(active.values())
        overall[bucket_of(n)] += dur
        by_count[n] = by_count.get(n, 0.0) + dur
        for name in active:
            per_class.setdefault(name, {b: 0.0 for b, _ in BUCKETS})[bucket_of(n)] += dur
            class_busy[name] = class_busy.get(name, 0.0) + dur
    busy_s = window_s - overall["0"]
    typical = 0
    if busy_s > 0:
        acc = 0.0
        for n in sorted(k for k in by_count if k > 0):
            acc += by_count[n]
            if acc >= TYPICAL_QUANTILE * busy_s - 1e-9:
                typical = n
                break
    overlapping_s = sum(d for n, d in by_count.items() if n >= 2)
    return {
        "window_s": window_s,
        "busy_s": busy_s,
        "requests": sum(1 for iv in intervals if iv.end_s > start_s and iv.start_s < end_s),
        "shares": {b: (d / window_s if window_s else 0.0) for b, d in overall.items()},
        # Of the time anything was running, the share with two or more requests at once.
        "overlap_share": overlapping_s / busy_s if busy_s > 0 else 0.0,
        "typical_overlap": typical,
        "per_class": {
            name: {"busy_s": class_busy[name],
                   "shares": {b: d / class_busy[name] for b, d in buckets.items()}}
            for name, buckets in sorted(per_class.items())
        },
    }


def intervals_from_log(session: Session, start: datetime, end: datetime) -> list[Interval]:
    """Active intervals of logged requests that overlap [start, end)."""
    # A request that arrived before the window can still be running in it; none runs for a day.
    rows = session.execute(
        select(RequestRecord.arrival_at, RequestRecord.total_ms, RequestRecord.class_name)
        .where(RequestRecord.arrival_at >= start - timedelta(days=1), RequestRecord.arrival_at < end,
               RequestRecord.total_ms.is_not(None))
    )
    return [Interval(at.timestamp(), at.timestamp() + total_ms / 1000, cls or "unknown")
            for at, total_ms, cls in rows]


def residency_advice(session: Session, start: datetime, end: datetime) -> list[dict]:
    """Per model: requests, cold starts and their measured cost per week; advice to pin where it pays."""
    window_s = (end - start).total_seconds()
    per_week = WEEK_S / window_s if window_s > 0 else 0.0
    requests: dict[str, int] = {}
    for (model,) in session.execute(select(RequestRecord.model).where(
            RequestRecord.arrival_at >= start, RequestRecord.arrival_at < end)):
        if model:
            requests[model] = requests.get(model, 0) + 1
    loads: dict[str, list[float]] = {}
    for name, event, cold_ms in session.execute(
            select(ResidencyEvent.model_name, ResidencyEvent.event, ResidencyEvent.cold_start_ms)
            .where(ResidencyEvent.at >= start, ResidencyEvent.at < end, ResidencyEvent.node.is_(None))):
        if event in LOAD_EVENTS:
            loads.setdefault(name, []).append(cold_ms or 0.0)
    policies = dict(session.execute(select(Model.name, Model.policy)).all())
    out = []
    for name in sorted(set(requests) | set(loads), key=lambda n: (-requests.get(n, 0), n)):
        cold = loads.get(name, [])
        cost_s_week = sum(cold) / 1000 * per_week
        policy = policies.get(name)
        pin = policy != "pinned" and bool(cold) and requests.get(name, 0) > 0
        out.append({
            "model": name,
            "requests": requests.get(name, 0),
            "requests_per_week": requests.get(name, 0) * per_week,
            "cold_starts": len(cold),
            "cold_start_mean_ms": sum(cold) / len(cold) if cold else None,
            "cold_start_s_per_week": cost_s_week,
            "policy": policy,
            "pin": pin,
        })
    return out


def traffic(session: Session, days: float, clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> dict:
    """The overlap histogram and residency advice over the last `days` days."""
    end = clock()
    start = end - timedelta(days=days)
    hist = histogram(intervals_from_log(session, start, end), start.timestamp(), end.timestamp())
    return {"days": days, "start": start.isoformat(), "end": end.isoformat(), **hist,
            "residency": residency_advice(session, start, end)}


def format_traffic(t: dict, rare_share: float) -> str:
    """The histogram and advice as `hearth traffic` prints them."""
    lines = [(f"request log, last {t['days']:g} days: {t['requests']} requests, busy {t['busy_s']:.0f} s of "
             f"{t['window_s']:.0f} s")]
    lines.append("share of time with N requests active: " +
                 "  ".join(f"{b}: {t['shares'][b] * 100:.2f}%" for b, _ in BUCKETS))
    lines.append(f"of the busy time, {t['overlap_share'] * 100:.1f}% had 2 or more requests at once; "
                 f"typical overlap (90% of busy time): {t['typical_overlap']}")
    for name, c in t["per_class"].items():
        lines.append(f"  {name:<11} busy {c['busy_s']:.0f} s; overall concurrency meanwhile: " +
                     "  ".join(f"{b}: {c['shares'][b] * 100:.0f}%" for b, _ in BUCKETS if b != "0"))
    if t["busy_s"] > 0 and t["overlap_share"] < rare_share:
        lines.append(f"requests rarely overlap (< {rare_share * 100:.0f}% of busy time): continuous batching "
                     "gains little here; residency and start-up latency come first")
    for r in t["residency"]:
        mean = "n/a" if r["cold_start_mean_ms"] is None else f"{r['cold_start_mean_ms']:.0f} ms"
        advice = "pin it" if r["pin"] else ("pinned" if r["policy"] == "pinned" else "leave as is")
        lines.append(f"  model {r['model']}: {r['requests']} requests ({r['requests_per_week']:.0f}/week), "
                     f"{r['cold_starts']} cold starts (mean {mean}), {r['cold_start_s_per_week']:.1f} s/week "
                     f"waiting for loads → {advice}")
    if not t["residency"]:
        lines.append("  no requests or loads in the window")
    return "\n".join(lines)
