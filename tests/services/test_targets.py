"""A new store's TPOT targets sized once from the default model's measured costs; an admin's own are kept."""

import pytest

from app.services.settings import SettingsCache
from app.services.targets import SIZED_KEY, TargetSizer
from app.store.db import open_store
from app.store.models import RequestClass, Setting
from app.store.settings import set_setting

MODEL = "gemma"
# A full batch of 8 keeps 173.3 ms a token beside a measured 64-token knee: voice (100) and chat/coding (150) are
# out of reach, documents (200) and background (500) are not.
FIGURES = {"full_batch_tpot_ms": 173.3, "full_batch_decode_ms": 60.0, "prefill_token_ms": 1.5,
           "prefill_knee": 64.0, "prefill_knee_measured": 1.0, "prefill_budget": 64.0}


@pytest.fixture
def sessions(tmp_path):
    """A migrated, seeded store."""
    engine, sessions = open_store(tmp_path)
    yield sessions
    engine.dispose()


def sizer(sessions, latest: dict, changed: list) -> TargetSizer:
    return TargetSizer(sessions, SettingsCache(sessions, ttl_s=0), lambda: latest, lambda: MODEL, lambda _: 8,
                       lambda: changed.append(True))


def tpot(sessions) -> dict[str, int]:
    with sessions() as s:
        return {r.name: r.tpot_target_ms for r in s.query(RequestClass)}


def test_shipped_targets_out_of_reach_are_raised_to_the_full_batch_pace_once(sessions):
    with sessions() as s:
        s.get(RequestClass, "chat").tpot_target_ms = 120  # the admin's own: never touched
        s.commit()
    latest = {f"runner:{MODEL}@local": dict(FIGURES, prefill_knee_measured=0.0)}
    changed = []
    job = sizer(sessions, latest, changed)
    assert job.run() is None and not changed  # the knee is still the default: not measured yet
    latest[f"runner:{MODEL}@local"]["prefill_knee_measured"] = 1.0
    assert job.run() == {"coding": [150, 180], "voice": [100, 180]}
    assert changed == [True]
    assert tpot(sessions) == {"voice": 180, "chat": 120, "coding": 180, "documents": 200, "background": 500}
    with sessions() as s:
        record = s.get(Setting, SIZED_KEY).value
    assert record["model"] == MODEL and record["knee_tokens"] == 64 and record["full_batch_tpot_ms"] == 173.3
    # Once per store: a fresh job (a restart) on slower figures changes nothing.
    latest[f"runner:{MODEL}@local"]["full_batch_tpot_ms"] = 400.0
    assert sizer(sessions, latest, []).run() is None
    assert tpot(sessions)["documents"] == 200


def test_nothing_is_sized_when_the_setting_is_off_or_no_runner_reports(sessions):
    with sessions() as s:
        set_setting(s, "size_targets_from_hardware", False)
        s.commit()
    assert sizer(sessions, {f"runner:{MODEL}@local": FIGURES}, []).run() is None
    with sessions() as s:
        set_setting(s, "size_targets_from_hardware", True)
        s.commit()
    assert sizer(sessions, {"runner:other@local": FIGURES}, []).run() is None
    assert tpot(sessions)["voice"] == 100
