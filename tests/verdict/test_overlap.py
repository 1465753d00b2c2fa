"""Concurrency histogram and residency advice over a synthetic request log, with an injected clock."""

from datetime import UTC, datetime, timedelta

import pytest

from app.store.db import open_store
from app.store.models import Model, RequestRecord, ResidencyEvent
from app.verdict.overlap import Interval, bucket_of, format_traffic, histogram, traffic

NOW = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)


def test_buckets():
    assert [bucket_of(n) for n in (0, 1, 2, 3, 4, 7, 8, 30)] == ["0", "1", "2", "2", "4", "4", "8+", "8+"]


def test_histogram_of_hand_made_intervals():
    # Window 0..100 s. voice 10..20, chat 15..30, background 15..18 and 50..60.
    ivs = [Interval(10, 20, "voice"), Interval(15, 30, "chat"), Interval(15, 18, "background"),
           Interval(50, 60, "background")]
    h = histogram(ivs, 0, 100)
    # Active counts: 0 for 10+20+40=70 s; 1 for 5 (10..15) + 10 (20..30) + 10 (50..60) = 25 s;
    # 2 for 2 s (18..20); 3 for 3 s (15..18).
    assert h["shares"] == pytest.approx({"0": 0.70, "1": 0.25, "2": 0.05, "4": 0.0, "8+": 0.0})
    assert h["busy_s"] == pytest.approx(30)
    assert h["overlap_share"] == pytest.approx(5 / 30)
    # 25 of 30 busy seconds have 1 active (83 %); 90 % is reached at 2.
    assert h["typical_overlap"] == 2
    voice = h["per_class"]["voice"]
    assert voice["busy_s"] == pytest.approx(10)
    # voice alone 10..15 (1), with chat+background 15..18 (3 → "2"), with chat 18..20 (2).
    assert voice["shares"] == pytest.approx({"0": 0.0, "1": 0.5, "2": 0.5, "4": 0.0, "8+": 0.0})
    assert h["per_class"]["background"]["busy_s"] == pytest.approx(13)


def test_back_to_back_requests_do_not_overlap_and_the_window_clips():
    h = histogram([Interval(-5, 10, "a"), Interval(10, 20, "a"), Interval(95, 130, "b")], 0, 100)
    assert h["shares"]["1"] == pytest.approx(0.25) and h["shares"]["2"] == 0.0
    assert h["overlap_share"] == 0.0 and h["typical_overlap"] == 1


def test_eight_or_more():
    h = histogram([Interval(0, 10, "bg")] * 9, 0, 20)
    assert h["shares"]["8+"] == pytest.approx(0.5) and h["typical_overlap"] == 9


def test_traffic_over_the_store_with_an_injected_clock(tmp_path):
    engine, sessions = open_store(tmp_path)
    with sessions() as s:
        s.add(Model(name="gemma", source="default", policy="keep_alive"))
        s.add(Model(name="big", source="folder", policy="pinned"))
        # Inside the 1-day window: two overlapping, one alone; outside: one 3 days ago.
        for minutes_ago, total_ms, cls, model in ((60, 4000, "voice", "gemma"), (60, 8000, "chat", "gemma"),
                                                  (30, 2000, "voice", "big"), (3 * 24 * 60, 5000, "chat", "gemma")):
            s.add(RequestRecord(arrival_at=NOW - timedelta(minutes=minutes_ago), total_ms=total_ms, class_name=cls,
                                model=model, status="ok"))
        s.add(ResidencyEvent(at=NOW - timedelta(hours=2), model_name="gemma", event="load", cold_start_ms=1200))
        s.add(ResidencyEvent(at=NOW - timedelta(hours=1, minutes=30), model_name="gemma", event="unload"))
        s.add(ResidencyEvent(at=NOW - timedelta(hours=1, minutes=5), model_name="gemma", event="load",
                             cold_start_ms=800))
        s.add(ResidencyEvent(at=NOW - timedelta(days=2), model_name="gemma", event="load", cold_start_ms=9999))
        s.commit()
        t = traffic(s, 1, clock=lambda: NOW)
    engine.dispose()
    assert t["requests"] == 3
    assert t["busy_s"] == pytest.approx(10)  # 8 s (two overlapping for 4) + 2 s
    assert t["overlap_share"] == pytest.approx(0.4)
    assert t["shares"]["2"] == pytest.approx(4 / 86400)
    gemma = next(r for r in t["residency"] if r["model"] == "gemma")
    assert gemma["requests"] == 2 and gemma["cold_starts"] == 2
    assert gemma["cold_start_mean_ms"] == pytest.approx(1000)
    assert gemma["cold_start_s_per_week"] == pytest.approx(2.0 * 7)
    assert gemma["pin"] is True
    big = next(r for r in t["residency"] if r["model"] == "big")
    assert big["pin"] is False and big["policy"] == "pinned"
    text = format_traffic(t, 0.1)
    assert "gemma" in text and "pin it" in text and "40.0%" in text


def test_traffic_on_an_empty_log(tmp_path):
    engine, sessions = open_store(tmp_path)
    with sessions() as s:
        t = traffic(s, 7, clock=lambda: NOW)
    engine.dispose()
    assert t["busy_s"] == 0 and t["shares"]["0"] == 1.0 and t["typical_overlap"] == 0
    assert "no requests" in format_traffic(t, 0.1)
