"""Read-side queries of the dashboard pages, against a real store."""

import random
from datetime import UTC, datetime, timedelta

import pytest

from app.gateway.classes import policy_of
from app.gateway.tokens import create_token, revoke_token
from app.residency.manager import ModelState
from app.store.db import open_store
from app.store.models import RequestClass, RequestRecord, ResidencyEvent
from app.telemetry.analysis import class_figures
from app.web.queries import (
    LoadProgress,
    QueryError,
    RequestFilters,
    class_figures_sql,
    class_stats,
    decode_cursor,
    encode_cursor,
    load_history,
    members_with_tokens,
    parse_request_filters,
    recent_events,
    request_page,
    state_label,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


@pytest.fixture
def sessions(tmp_path):
    db_engine, sessions = open_store(tmp_path)
    yield sessions
    db_engine.dispose()


def test_sql_class_figures_equal_the_analysis_module(sessions):
    rng = random.Random(3)
    classes = ["voice", "chat", "documents", "coding", "background", "retired"]
    with sessions() as s:
        for _ in range(600):
            status = rng.choice(["ok", "ok", "ok", "error", "timeout"])
            s.add(RequestRecord(
                arrival_at=NOW - timedelta(minutes=rng.uniform(0, 180)), class_name=rng.choice(classes),
                status=status, ttft_ms=rng.choice([None, rng.uniform(0, 4000)]),
                tpot_ms=rng.choice([None, rng.uniform(0, 300)]),
                completion_tokens=rng.choice([None, rng.randint(0, 500)])))
        s.commit()
        policies = {r.name: policy_of(r) for r in s.query(RequestClass)}
        start, end = NOW - timedelta(hours=2), NOW
        assert class_figures_sql(s, start, end) == class_figures(s, policies, start, end)
        assert "retired" not in {f.name for f in class_figures_sql(s, start, end)}  # no policy, as in analysis


def test_class_stats_window_and_fairness(sessions):
    with sessions() as s:
        weights = {r.name: r.weight for r in s.query(RequestClass)}
        s.add_all([
            RequestRecord(arrival_at=NOW - timedelta(minutes=5), class_name="voice", status="ok", ttft_ms=1,
                          completion_tokens=int(100 * weights["voice"])),
            RequestRecord(arrival_at=NOW - timedelta(minutes=50), class_name="chat", status="ok", ttft_ms=1,
                          completion_tokens=int(100 * weights["chat"])),
            RequestRecord(arrival_at=NOW - timedelta(hours=3), class_name="background", status="ok", ttft_ms=1,
                          completion_tokens=0),
        ])
        s.commit()
        hour = class_stats(s, "1h", NOW)
        assert set(hour.figures) == {"voice", "chat"} and hour.fairness == pytest.approx(1.0)
        day = class_stats(s, "24h", NOW)
        # background had demand and got nothing: Jain's index of (100, 100, 0) is 2/3.
        assert day.fairness == pytest.approx(2 / 3) and day.service_per_weight["background"] == 0
        with pytest.raises(QueryError):
            class_stats(s, "1y", NOW)


def test_cursor_round_trip_and_garbage():
    row = RequestRecord(id=42, arrival_at=datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC))
    assert decode_cursor(encode_cursor(row)) == (row.arrival_at, 42)
    for bad in ("", "x-1", "12", "1-2-3", "99999999999999999999999-1"):
        with pytest.raises(QueryError):
            decode_cursor(bad)


def test_request_page_ties_on_arrival_time_are_neither_lost_nor_repeated(sessions):
    with sessions() as s:
        # Eleven rows share one arrival time: the id breaks the tie.
        s.add_all([RequestRecord(arrival_at=NOW - timedelta(seconds=i // 11), status="ok") for i in range(33)])
        s.commit()
        seen, before = [], None
        while True:
            page = request_page(s, RequestFilters(), NOW, before=before, limit=4)
            seen += [r.id for r in page.rows]
            if not page.older:
                break
            before = page.older
        assert sorted(seen) == list(range(1, 34)) and len(set(seen)) == 33
        with pytest.raises(QueryError):
            request_page(s, RequestFilters(), NOW, limit=0)


def test_parse_filters():
    f = parse_request_filters({"member": " alice ", "class": "voice", "status": "ok", "range": "24h"})
    assert f == RequestFilters("alice", "voice", "", "ok", "24h")
    assert f.as_args() == {"member": "alice", "class": "voice", "status": "ok", "range": "24h"}
    for bad in ({"status": "fine"}, {"range": "2d"}):
        with pytest.raises(QueryError):
            parse_request_filters(bad)


def test_members_with_tokens_keeps_revoked_ones(sessions):
    with sessions() as s:
        create_token(s, "alice", "voice", ["chat"])
        _, info = create_token(s, "bob", "chat")
        revoke_token(s, str(info.id))
        members = {m.name: m for m in members_with_tokens(s)}
    assert members["alice"].active == 1 and members["bob"].active == 0 and len(members["bob"].tokens) == 1


def test_events_history_and_state_labels(sessions):
    with sessions() as s:
        for i, (event, ms) in enumerate([("load", 1000.0), ("unload", None), ("load", 3000.0), ("evict", None)]):
            s.add(ResidencyEvent(at=NOW + timedelta(minutes=i), model_name="m", event=event, reason="r",
                                 cold_start_ms=ms, measured_bytes=123 if event == "load" else None))
        s.commit()
        events = recent_events(s, limit=3)
        assert [e.event for e in events] == ["evict", "load", "unload"]
        history = load_history(s, ["m", "never-loaded"])
    assert history["m"]["cold_starts_ms"] == [3000.0, 1000.0] and history["m"]["last_event"] == "evict"
    assert history["never-loaded"] == {"cold_starts_ms": [], "measured_bytes": None, "last_event": None, "loads": []}
    # Loads recorded without a split (before migration 0014, or a stock llama-server) are one part each.
    assert [[(p.key, p.ms) for p in b.parts] for b in history["m"]["loads"]] == [[("whole", 3000.0)], [("whole", 1000.0)]]
    assert state_label(None, "evict") == (ModelState.UNLOADED, "not loaded", "neutral")
    assert state_label({"state": ModelState.UNLOADED}, "evict") == (ModelState.UNLOADED, "evicted to make room", "warn")
    assert state_label({"state": ModelState.READY, "in_flight": 2}, None) == (ModelState.READY, "resident · serving 2", "ok")
    assert state_label({"state": ModelState.READY, "in_flight": 0, "idle_s": 125}, None) == (
        ModelState.READY, "resident · idle 2 min", "ok")
    assert state_label({"state": ModelState.CRASHED}, "crash")[:2] == (ModelState.CRASHED, "crashed · restarts on the next request")
    assert LoadProgress(3.0, 2.0).pct == 99 and LoadProgress(1.0, 4.0).pct == 25 and LoadProgress(1.0, None).pct is None
