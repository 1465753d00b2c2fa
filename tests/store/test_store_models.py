"""The models' column types: aware UTC datetimes."""

from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import StatementError

from app.store.models import Member, ResidencyEvent


def test_datetimes_are_stored_in_utc_and_read_back_aware(sessions):
    paris = timezone(timedelta(hours=2))
    with sessions() as session:
        session.add(Member(name="ana", created_at=datetime(2025, 6, 1, 12, 0, tzinfo=paris)))
        session.commit()
        stored = session.execute(text("SELECT created_at FROM members")).scalar()
    assert stored == "2025-06-01 10:00:00.000000"
    with sessions() as session:
        created_at = session.scalars(select(Member.created_at)).one()
    assert created_at == datetime(2025, 6, 1, 10, 0, tzinfo=UTC)
    assert created_at.tzinfo is UTC


def test_naive_datetimes_are_refused(sessions):
    with sessions() as session:
        session.add(ResidencyEvent(at=datetime(2025, 6, 1, 12, 0), model_name="gemma", event="load"))
        with pytest.raises(StatementError, match="naive datetime"):
            session.commit()


def test_timestamps_default_to_now(sessions):
    before = datetime.now(UTC)
    with sessions() as session:
        session.add(ResidencyEvent(model_name="gemma", event="load"))
        session.commit()
        assert before <= session.scalars(select(ResidencyEvent.at)).one() <= datetime.now(UTC)
