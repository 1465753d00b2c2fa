"""Overlap distribution, bursts and residency advice over a synthetic request log, with an injected clock."""

from datetime import UTC, datetime, timedelta

import pytest

from app.store.db import open_store
from app.store.models import Model, RequestRecord, ResidencyEvent
from app.verdict.overlap import BUCKET_LABELS, Interval, bucket_of, format_traffic, histogram, level_for, traffic

NOW = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)


def test_buckets_and_levels():
    assert list(BUCKET_LABELS.values()) == ["1", "2–3", "4–7", "8–15", "16–31", "32+"]
    assert [bucket_of(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 300)] == [
        "1", "2", "2", "4", "4", "8", "8", "16", "16", "32+", "32+"]
    assert [level_for(n) for n in (1, 3, 4, 9, 24, 33, 100)] == [1, 4, 4, 16, 32, 64, 64]


def test_distribution_of_hand_made_intervals():
    # Window 0..100 s. voice 10..20, chat 15..30, background 15..18 and 50..60.
    ivs = [Interval(10, 20, "voice"), Interval(15, 30, "chat"), Interval(15, 18, "background"),
           Interval(50, 60, "background")]
    h = histogram(ivs, 0, 100)
    # Active counts: 1 for 5 (10..15) + 10 (20..30) + 10 (50..60) = 25 s; 2 for 2 s (18..20);
    # 3 for 3 s (15..18); idle 70 s.
    assert h["busy_s"] == pytest.approx(30) and h["idle_share"] == pytest.approx(0.7)
    assert h["busy_shares"] == pytest.approx({"1": 25 / 30, "2": 5 / 30, "4": 0, "8": 0, "16": 0, "32+": 0})
    assert h["busy_s_by_count"] == pytest.approx({"1": 25, "2": 2, "3": 3})
    assert h["overlap_share"] == pytest.approx(5 / 30) and h["peak_overlap"] == 3
    # 25 of 30 busy seconds have 1 active (83 %); 90 % is reached at 2.
    assert h["typical_overlap"] == 2 and h["bursts"] == []
    voice = h["per_class"]["voice"]
    assert voice["busy_s"] == pytest.approx(10)
    # voice alone 10..15 (1), with chat+background 15..18 (3 → "2"), with chat 18..20 (2).
    assert voice["shares"] == pytest.approx({"1": 0.5, "2": 0.5, "4": 0, "8": 0, "16": 0, "32+": 0})
    assert h["per_class"]["background"]["busy_s"] == pytest.approx(13)


def test_back_to_back_requests_do_not_overlap_and_the_window_clips():
    h = histogram([Interval(-5, 10, "a"), Interval(10, 20, "a"), Interval(95, 130, "b")], 0, 100)
    assert h["busy_s"] == pytest.approx(25) and h["busy_shares"]["1"] == 1.0
    assert h["overlap_share"] == 0.0 and h["typical_overlap"] == 1


def test_one_batch_job_is_a_burst_not_the_typical_overlap():
    # An hour of one-at-a-time chat (10 s every 20 s), then a job of 24 requests at once.
    ivs = [Interval(t, t + 10, "chat") for t in range(0, 3600, 20)]
    job = [Interval(4000 + i * 0.1, 4000 + 30 + i, "background") for i in range(24)]
    h = histogram(ivs + job, 0, 5000)
    assert h["peak_overlap"] == 24 and h["typical_overlap"] == 1
    (burst,) = h["bursts"]
    # The burst spans its requests' whole lives, ramp-up and tail included.
    assert burst["start_s"] == 4000 and burst["end_s"] == pytest.approx(4053)
    assert (burst["peak"], burst["requests"], burst["classes"]) == (24, 24, {"background": 24})
    assert h["burst_busy_s"] == pytest.approx(53) and h["typical_busy_s"] == pytest.approx(1800)
    # Counted as what it is: time at 16–31 requests at once.
    assert h["busy_shares"]["16"] > 0 and h["busy_shares"]["32+"] == 0
    # Without the burst rule it would be the typical overlap: most of the busy time of a log
    # that holds only the job is spent at 8 or more.
    only = histogram(job, 0, 5000, burst_overlap=100)
    assert only["bursts"] == [] and only["typical_overlap"] >= 8
    assert histogram(job, 0, 5000)["typical_busy_s"] == 0


def test_bursts_in_waves_are_one_and_far_apart_are_two():
    wave = [Interval(100 + i * 0.01, 110, "background") for i in range(10)]
    again = [Interval(140 + i * 0.01, 150, "coding") for i in range(10)]
    later = [Interval(1000 + i * 0.01, 1010, "background") for i in range(10)]
    h = histogram(wave + again + later, 0, 2000)
    first, second = h["bursts"]
    assert (first["start_s"], first["end_s"], first["requests"]) == (100, 150, 20)
    assert first["classes"] == {"background": 10, "coding": 10}
    assert (second["start_s"], second["requests"]) == (1000, 10)
    # Fewer than 8 at once is not a burst.
    assert histogram(wave[:7], 0, 200)["bursts"] == []


def test_traffic_over_the_store_with_an_injected_clock(tmp_path):
    db_engine, sessions = open_store(tmp_path)
    with sessions() as s:
        s.add(Model(name="gemma", source="default", policy="keep_alive"))
        s.add(Model(name="big", source="folder", policy="pinned"))
        # Inside the 1-day window: two overlapping, one alone; outside: one 3 days ago.
        for minutes_ago, total_ms, cls, model in ((60, 4000, "voice", "gemma"), (60, 8000, "chat", "gemma"),
                                                  (30, 2000, "voice", "big"), (3 * 24 * 60, 5000, "chat", "gemma")):
            s.add(RequestRecord(arrival_at=NOW - timedelta(minutes=minutes_ago), total_ms=total_ms, class_name=cls,
                                model=model, status="ok"))
        # A burst 10 hours ago: 12 background requests at once.
        for i in range(12):
            s.add(RequestRecord(arrival_at=NOW - timedelta(hours=10), total_ms=20_000 + i * 100,
                                class_name="background", model="gemma", status="ok"))
        s.add(ResidencyEvent(at=NOW - timedelta(hours=2), model_name="gemma", event="load", cold_start_ms=1200))
        s.add(ResidencyEvent(at=NOW - timedelta(hours=1, minutes=30), model_name="gemma", event="unload"))
        s.add(ResidencyEvent(at=NOW - timedelta(hours=1, minutes=5), model_name="gemma", event="load",
                             cold_start_ms=800))
        s.add(ResidencyEvent(at=NOW - timedelta(days=2), model_name="gemma", event="load", cold_start_ms=9999))
        s.commit()
        t = traffic(s, 1, clock=lambda: NOW)
        quiet = traffic(s, 1, clock=lambda: NOW, burst_overlap=20)
    db_engine.dispose()
    assert t["requests"] == 15
    (burst,) = t["bursts"]
    assert burst["start"] == "2026-03-02T02:00:00+00:00" and burst["peak"] == 12 and burst["requests"] == 12
    assert burst["duration_s"] == pytest.approx(21.1)
    # Outside the burst: 8 s (two overlapping for 4) + 2 s.
    assert t["typical_busy_s"] == pytest.approx(10) and t["typical_overlap"] == 2
    assert t["busy_s"] == pytest.approx(10 + 21.1)
    assert quiet["bursts"] == [] and quiet["typical_overlap"] == 12
    gemma = next(r for r in t["residency"] if r["model"] == "gemma")
    assert gemma["requests"] == 14 and gemma["cold_starts"] == 2
    assert gemma["cold_start_mean_ms"] == pytest.approx(1000)
    assert gemma["cold_start_s_per_week"] == pytest.approx(2.0 * 7)
    assert gemma["pin"] is True
    big = next(r for r in t["residency"] if r["model"] == "big")
    assert big["pin"] is False and big["policy"] == "pinned"
    text = format_traffic(t, 0.1)
    assert "gemma" in text and "pin it" in text
    assert "1 burst(s) of 8 or more at once" in text
    assert "burst 2026-03-02 02:00 UTC, 21 s: 12 requests, up to 12 at once (background 12)" in text
    assert "typical overlap (90% of the busy time outside bursts): 2" in text
    # The distribution is drawn as bars, one per bucket.
    assert "  32+ at once" in text and "  2–3 at once" in text and "█" in text
    # A burst means requests do not rarely overlap, even when most busy time is single.
    assert "rarely overlap" not in text


def test_traffic_on_an_empty_log(tmp_path):
    db_engine, sessions = open_store(tmp_path)
    with sessions() as s:
        t = traffic(s, 7, clock=lambda: NOW)
    db_engine.dispose()
    assert t["busy_s"] == 0 and t["idle_share"] == 1.0 and t["typical_overlap"] == 0 and t["bursts"] == []
    assert "no requests" in format_traffic(t, 0.1)
