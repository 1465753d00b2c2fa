"""Token listing: last use comes from the request log, never the token itself."""

from datetime import UTC, datetime, timedelta

import pytest

from app.gateway.tokens import create_token, list_tokens, revoke_token
from app.store.db import database_path, make_engine, session_factory, upgrade
from app.store.models import RequestRecord
from app.store.seed import seed_defaults


@pytest.fixture
def sessions(tmp_path):
    """Sessions on a fresh migrated store."""
    engine = make_engine(database_path(tmp_path))
    upgrade(engine, "head")
    yield session_factory(engine)
    engine.dispose()


def test_last_used_is_the_latest_request_of_that_token(sessions):
    with sessions() as s:
        seed_defaults(s)
        s.commit()
        _, alice = create_token(s, "alice", "chat")
        _, bob = create_token(s, "bob", "voice")
        t0 = datetime(2026, 11, 1, 12, 0, 0, tzinfo=UTC)
        s.add_all([
            RequestRecord(arrival_at=t0, class_name="chat", status="ok", token_id=alice.id),
            RequestRecord(arrival_at=t0 + timedelta(hours=2), class_name="chat", status="ok", token_id=alice.id),
            RequestRecord(arrival_at=t0 + timedelta(hours=5), class_name="chat", status="ok", token_id=None),
        ])
        s.commit()
        listed = {t.member: t for t in list_tokens(s)}
        assert listed["alice"].last_used_at == "2026-11-01T14:00:00+00:00"
        assert listed["bob"].last_used_at is None
        revoked = revoke_token(s, str(bob.id))
        assert revoked.revoked and revoked.last_used_at is None
