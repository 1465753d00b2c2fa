"""How often the household's requests really overlap, from the request log, and what residency to do about it.

A request is active from its arrival to its end (arrival + total_ms). Over a window:

- the overlap distribution is the share of *busy* time (one request or more active) spent at
  1, 2–3, 4–7, 8–15, 16–31 and 32+ requests at once, time-weighted: a request that runs ten
  seconds weighs ten times one that runs one;
- a burst is a stretch where `burst_overlap` or more requests are active at once (a batch job,
  agent branches), widened to the whole lives of the requests active in it and merged with the
  next one when less than BURST_GAP_S apart; bursts are named apart (when, how long, how many
  requests, which classes);
- the typical overlap is the count reached by 90 % of the busy time *outside* bursts, so one
  evening's batch job is visible as a burst and does not become the household's character.

Residency advice comes from the same window: requests per model, and the cold starts paid for them.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.store.models import Model, RequestRecord, ResidencyEvent

# The bench's overlap levels; the distribution's buckets start at the same counts.
LEVELS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
MAX_LEVEL = LEVELS[-1]
# (label, lowest count in the bucket); a bucket runs up to the next one's lowest count.
BUCKETS: tuple[tuple[str, int], ...] = (("1", 1), ("2", 2), ("4", 4), ("8", 8), ("16", 16), ("32+", 32))
# What each bucket is called where people read it: "2–3", "32+".
BUCKET_LABELS: dict[str, str] = {
    name: (name if i + 1 == len(BUCKETS) or BUCKETS[i + 1][1] - 1 == low else f"{low}–{BUCKETS[i + 1][1] - 1}")
    for i, (name, low) in enumerate(BUCKETS)
}
WEEK_S = 7 * 24 * 3600
TYPICAL_QUANTILE = 0.9  # the overlap the household meets in 90 % of its busy time outside bursts
BURST_GAP_S = 60.0  # hot stretches closer than this are one burst (a job that submits in waves)
DEFAULT_BURST_OVERLAP = 8
LOAD_EVENTS = ("load", "restart")


@dataclass(frozen=True)
class Interval:
    """One request's active time, in Unix seconds."""

    start_s: float
    end_s: float
    class_name: str


def bucket_of(count: int) -> str:
    """The distribution bucket label of a concurrency count (1 or more)."""
    label = BUCKETS[0][0]
    for name, low in BUCKETS:
        if count >= low:
            label = name
    return label


def level_for(count: int) -> int:
    """The bench level that covers `count` requests at once: the next level up, at most MAX_LEVEL."""
    return next((lv for lv in LEVELS if lv >= count), MAX_LEVEL)


def _segments(intervals: list[Interval], start_s: float, end_s: float) -> Iterable[tuple[float, float, int]]:
    """(start, duration, active count) for each stretch of the window where the count does not change."""
    events: list[tuple[float, int]] = []
    for iv in intervals:
        a, b = max(iv.start_s, start_s), min(iv.end_s, end_s)
        if b > a:
            events.append((a, 1))
            events.append((b, -1))
    # Ends before starts at the same instant: back-to-back requests do not overlap.
    events.sort()
    active = 0
    t = start_s
    for at, delta in events:
        if at > t:
            yield t, at - t, active
            t = at
        active += delta
    if end_s > t:
        yield t, end_s - t, active


def _class_segments(intervals: list[Interval], start_s: float, end_s: float) -> Iterable[tuple[float, dict[str, int]]]:
    """(duration, active count per class) for each stretch where nothing changes."""
    events: list[tuple[float, int, str]] = []
    for iv in intervals:
        a, b = max(iv.start_s, start_s), min(iv.end_s, end_s)
        if b > a:
            events.append((a, 1, iv.class_name))
            events.append((b, -1, iv.class_name))
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


def _bursts(intervals: list[Interval], segments: list[tuple[float, float, int]], start_s: float, end_s: float,
            burst_overlap: int) -> list[dict]:
    """Stretches with burst_overlap or more active, widened to their requests' lives and merged when close."""
    hot: list[list[float]] = []
    for at, dur, n in segments:
        if n >= burst_overlap:
            if hot and hot[-1][1] >= at:
                hot[-1][1] = at + dur
            else:
                hot.append([at, at + dur])
    if not hot:
        return []
    # Which hot stretch each request meets (they are disjoint and sorted: bisect on their ends).
    hot_ends = [b for _, b in hot]
    members: list[list[int]] = [[] for _ in hot]
    for i, iv in enumerate(intervals):
        k = bisect_right(hot_ends, iv.start_s)
        while k < len(hot) and hot[k][0] < iv.end_s:
            if iv.end_s > hot[k][0] and iv.start_s < hot[k][1]:
                members[k].append(i)
            k += 1
    extents: list[dict] = []
    for k in range(len(hot)):
        lo = max(start_s, min(intervals[i].start_s for i in members[k]))
        hi = min(end_s, max(intervals[i].end_s for i in members[k]))
        if extents and lo <= extents[-1]["end_s"] + BURST_GAP_S:
            extents[-1]["end_s"] = max(extents[-1]["end_s"], hi)
            extents[-1]["members"].update(members[k])
        else:
            extents.append({"start_s": lo, "end_s": hi, "members": set(members[k])})
    peaks = [0] * len(extents)
    k = 0
    for at, dur, n in segments:
        while k < len(extents) and extents[k]["end_s"] <= at:
            k += 1
        if k < len(extents) and at + dur > extents[k]["start_s"]:
            peaks[k] = max(peaks[k], n)
    out = []
    for e, peak in zip(extents, peaks):
        classes = Counter(intervals[i].class_name for i in e["members"])
        out.append({"start_s": e["start_s"], "end_s": e["end_s"], "duration_s": e["end_s"] - e["start_s"],
                    "peak": peak, "requests": len(e["members"]),
                    "classes": dict(sorted(classes.items(), key=lambda kv: (-kv[1], kv[0])))})
    return out


def _quantile_count(by_count: dict[int, float], q: float) -> int:
    """The smallest count reached by share q of the time in by_count (0 when it is empty)."""
    total = sum(by_count.values())
    acc = 0.0
    for n in sorted(by_count):
        acc += by_count[n]
        if acc >= q * total - 1e-9:
            return n
    return 0


def histogram(intervals: list[Interval], start_s: float, end_s: float,
              burst_overlap: int = DEFAULT_BURST_OVERLAP) -> dict:
    """The overlap distribution over busy time, bursts named apart, and the typical overlap outside them."""
    window_s = max(0.0, end_s - start_s)
    segments = list(_segments(intervals, start_s, end_s))
    bursts = _bursts(intervals, segments, start_s, end_s, burst_overlap)
    by_count: dict[int, float] = {}
    outside: dict[int, float] = {}
    k = 0  # segments and bursts are both in time order
    for at, dur, n in segments:
        while k < len(bursts) and bursts[k]["end_s"] <= at:
            k += 1
        if n == 0:
            continue
        by_count[n] = by_count.get(n, 0.0) + dur
        if not (k < len(bursts) and bursts[k]["start_s"] <= at):
            outside[n] = outside.get(n, 0.0) + dur
    busy_s = sum(by_count.values())
    buckets = {name: 0.0 for name, _ in BUCKETS}
    for n, d in by_count.items():
        buckets[bucket_of(n)] += d
    per_class: dict[str, dict[str, float]] = {}
    class_busy: dict[str, float] = {}
    for dur, active in _class_segments(intervals, start_s, end_s):
        n = sum(active.values())
        for name in active:
            per_class.setdefault(name, {b: 0.0 for b, _ in BUCKETS})[bucket_of(n)] += dur
            class_busy[name] = class_busy.get(name, 0.0) + dur
    typical_busy_s = sum(outside.values())
    return {
        "window_s": window_s,
        "busy_s": busy_s,
        "requests": sum(1 for iv in intervals if iv.end_s > start_s and iv.start_s < end_s),
        "idle_share": (window_s - busy_s) / window_s if window_s else 1.0,
        # Of the busy time, the share at each bucket: the household's overlap distribution.
        "busy_shares": {b: (d / busy_s if busy_s else 0.0) for b, d in buckets.items()},
        # Busy seconds at each exact count, so the shares and quantiles can be re-derived.
        "busy_s_by_count": {str(n): by_count[n] for n in sorted(by_count)},
        # Of the time anything was running, the share with two or more requests at once.
        "overlap_share": sum(d for n, d in by_count.items() if n >= 2) / busy_s if busy_s else 0.0,
        "typical_overlap": _quantile_count(outside, TYPICAL_QUANTILE),
        "typical_busy_s": typical_busy_s,
        "peak_overlap": max(by_count, default=0),
        "burst_overlap": burst_overlap,
        "bursts": bursts,
        "burst_busy_s": busy_s - typical_busy_s,
        "per_class": {
            name: {"busy_s": class_busy[name],
                   "shares": {b: d / class_busy[name] for b, d in shares.items()}}
            for name, shares in sorted(per_class.items())
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


def traffic(session: Session, days: float, clock: Callable[[], datetime] = lambda: datetime.now(UTC),
            burst_overlap: int = DEFAULT_BURST_OVERLAP) -> dict:
    """The overlap distribution, bursts and residency advice over the last `days` days."""
    end = clock()
    start = end - timedelta(days=days)
    hist = histogram(intervals_from_log(session, start, end), start.timestamp(), end.timestamp(), burst_overlap)
    for b in hist["bursts"]:
        b["start"] = datetime.fromtimestamp(b["start_s"], UTC).isoformat(timespec="seconds")
    return {"days": days, "start": start.isoformat(), "end": end.isoformat(), **hist,
            "residency": residency_advice(session, start, end)}


def describe_burst(b: dict) -> str:
    """One burst in words: when, how long, how many requests at the peak, which classes."""
    when = datetime.fromtimestamp(b["start_s"], UTC).strftime("%Y-%m-%d %H:%M UTC")
    classes = ", ".join(f"{name} {n}" for name, n in b["classes"].items())
    return (f"{when}, {_duration(b['duration_s'])}: {b['requests']} requests, up to {b['peak']} at once "
            f"({classes})")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def is_rare(t: dict | None, rare_share: float) -> bool:
    """Requests rarely overlap: little of the busy time has two at once, and no burst happened."""
    return bool(t) and t["busy_s"] > 0 and t["overlap_share"] < rare_share and not t["bursts"]


def format_distribution(t: dict, width: int = 40) -> list[str]:
    """The overlap distribution as text bars, one line per bucket."""
    lines = []
    for name, _ in BUCKETS:
        share = t["busy_shares"][name]
        bar = "█" * round(share * width)
        lines.append(f"  {BUCKET_LABELS[name]:>5} at once  {bar:<{width}} {share * 100:5.1f}%")
    return lines


def format_overlap(t: dict) -> str:
    """The distribution, the bursts and the typical overlap outside them, as text."""
    lines = [f"{t['requests']} requests, busy {t['busy_s']:.0f} s of {t['window_s']:.0f} s"]
    if t["busy_s"] <= 0:
        return "\n".join(lines)
    lines.append("share of busy time by requests at once (time-weighted):")
    lines += format_distribution(t)
    lines.append(f"of the busy time, {t['overlap_share'] * 100:.1f}% had 2 or more requests at once; "
                 f"peak {t['peak_overlap']} at once")
    if t["bursts"]:
        lines.append(f"{len(t['bursts'])} burst(s) of {t['burst_overlap']} or more at once "
                     f"({t['burst_busy_s']:.0f} s of busy time), named apart:")
        lines += [f"  burst {describe_burst(b)}" for b in t["bursts"]]
    else:
        lines.append(f"no bursts ({t['burst_overlap']} or more at once)")
    typical = f"{t['typical_overlap']}" if t["typical_busy_s"] > 0 else "n/a (all busy time is in bursts)"
    lines.append(f"typical overlap (90% of the busy time outside bursts): {typical}")
    return "\n".join(lines)


def format_traffic(t: dict, rare_share: float) -> str:
    """The distribution, bursts and advice as `hearth traffic` prints them."""
    lines = [f"request log, last {t['days']:g} days: " + format_overlap(t)]
    for name, c in t["per_class"].items():
        lines.append(f"  {name:<11} busy {c['busy_s']:.0f} s; requests at once meanwhile: " +
                     "  ".join(f"{b}: {c['shares'][b] * 100:.0f}%" for b, _ in BUCKETS))
    if is_rare(t, rare_share):
        lines.append(f"requests rarely overlap (< {rare_share * 100:.0f}% of busy time, no bursts): continuous "
                     "batching gains little here; residency and start-up latency come first")
    for r in t["residency"]:
        mean = "n/a" if r["cold_start_mean_ms"] is None else f"{r['cold_start_mean_ms']:.0f} ms"
        advice = "pin it" if r["pin"] else ("pinned" if r["policy"] == "pinned" else "leave as is")
        lines.append(f"  model {r['model']}: {r['requests']} requests ({r['requests_per_week']:.0f}/week), "
                     f"{r['cold_starts']} cold starts (mean {mean}), {r['cold_start_s_per_week']:.1f} s/week "
                     f"waiting for loads → {advice}")
    if not t["residency"]:
        lines.append("  no requests or loads in the window")
    return "\n".join(lines)
