"""The class registry: policies read from the store, cached for ttl_s, dropped on invalidate()."""

import pytest

from app.gateway.classes import ClassRegistry
from app.store.db import open_store
from app.store.models import RequestClass
from tests.helpers import Clock


@pytest.fixture
def sessions(tmp_path):
    """A migrated store seeded with the shipped classes."""
    engine, sessions = open_store(tmp_path)
    yield sessions
    engine.dispose()


def _set_ttft(sessions, name: str, ms: int) -> None:
    with sessions() as s:
        s.get(RequestClass, name).ttft_target_ms = ms
        s.commit()


def test_an_edit_applies_after_the_ttl(sessions):
    clock = Clock()
    registry = ClassRegistry(sessions, ttl_s=5.0, clock=clock)
    before = registry.get("chat").ttft_target_ms
    _set_ttft(sessions, "chat", before + 1)
    clock.now += 4.9
    assert registry.get("chat").ttft_target_ms == before
    clock.now += 0.1
    assert registry.get("chat").ttft_target_ms == before + 1


def test_invalidate_reloads_at_once(sessions):
    registry = ClassRegistry(sessions, clock=Clock())
    assert registry.get("nope") is None
    assert registry.names()[0] == "voice"  # by priority
    _set_ttft(sessions, "voice", 123)
    registry.invalidate()
    assert registry.get("voice").ttft_target_ms == 123
