"""The settings cache: stored values (None included) for ttl_s, then read again."""

import pytest

from app.services.settings import SettingsCache
from app.store.db import open_store
from app.store.settings import UnknownSetting, set_setting
from tests.helpers import Clock


@pytest.fixture
def sessions(tmp_path):
    """A migrated, seeded store."""
    engine, sessions = open_store(tmp_path)
    yield sessions
    engine.dispose()


def _store(sessions, name, value):
    with sessions() as s:
        set_setting(s, name, value)
        s.commit()


def test_an_edit_applies_after_the_ttl_even_over_a_none(sessions):
    clock = Clock()
    settings = SettingsCache(sessions, ttl_s=5.0, clock=clock)
    assert settings.get("memory_limit_mb") is None  # the default, cached like any value
    _store(sessions, "memory_limit_mb", 2048)
    clock.now += 4.9
    assert settings.get("memory_limit_mb") is None
    clock.now += 0.1
    assert settings.get("memory_limit_mb") == 2048


def test_invalidate_reads_again_and_unknown_names_raise(sessions):
    settings = SettingsCache(sessions, clock=Clock())
    assert settings.get("max_in_flight_total") == 64
    _store(sessions, "max_in_flight_total", 8)
    settings.invalidate()
    assert settings.get("max_in_flight_total") == 8
    with pytest.raises(UnknownSetting):
        settings.get("colour")
