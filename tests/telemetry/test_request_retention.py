"""Retention of the request log and the refusal counts (requests_retention_days), pruned hourly like the samples."""

from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select, text

from app.store.models import RequestRecord
from app.store.settings import set_setting
from app.telemetry import rollup
from app.telemetry.rollup import prune_requests, to_unix

NOW = datetime(2026, 6, 1, 12, tzinfo=UTC)


def _add(session, days_ago: float, n: int = 1) -> None:
    for _ in range(n):
        session.add(RequestRecord(arrival_at=NOW - timedelta(days=days_ago), member_name="alice", status="ok"))


def test_rows_older_than_the_retention_go_and_the_rest_stay(sessions):
    with sessions() as s:
        _add(s, 100, 3)
        _add(s, 89.9, 2)
        s.execute(text("INSERT INTO refusals VALUES (:b, 'kid', 'voice', 'class_queue_full', 7)"),
                  [{"b": to_unix(NOW - timedelta(days=d))} for d in (95, 1)])
        s.commit()
        assert prune_requests(s, NOW) == {"requests": 3, "refusals": 1}  # the default: 90 days
        s.commit()
        assert s.scalar(select(func.count()).select_from(RequestRecord)) == 2
        set_setting(s, "requests_retention_days", 30)
        s.commit()
        assert prune_requests(s, NOW) == {"requests": 2, "refusals": 0}
        assert prune_requests(s, NOW, timedelta(days=365)) == {"requests": 0, "refusals": 0}


def test_one_pass_deletes_a_bounded_number_of_rows(sessions, monkeypatch):
    monkeypatch.setattr(rollup, "MAX_PRUNED_REQUESTS", 4)
    with sessions() as s:
        _add(s, 200, 10)
        s.commit()
        assert prune_requests(s, NOW)["requests"] == 4
        assert prune_requests(s, NOW)["requests"] == 4
        assert prune_requests(s, NOW)["requests"] == 2
