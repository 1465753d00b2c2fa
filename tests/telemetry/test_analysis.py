"""SLO attainment and fairness over a real store, with fixed timestamps."""

from datetime import UTC, datetime, timedelta

import pytest

from app.policy import ClassPolicy
from app.store.db import open_store
from app.store.models import RequestRecord
from app.telemetry.analysis import class_figures, fairness, jain_index, meets_targets

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
VOICE = ClassPolicy("voice", ttft_target_ms=500, tpot_target_ms=100, weight=4)
CHAT = ClassPolicy("chat", ttft_target_ms=1500, tpot_target_ms=150, weight=1)


def req(klass, ttft, tpot, tokens, status="ok", minutes=0):
    return RequestRecord(arrival_at=T0 + timedelta(minutes=minutes), class_name=klass, status=status,
                         ttft_ms=ttft, tpot_ms=tpot, completion_tokens=tokens, stream=True, num_preemptions=0)


def test_jain_index_bounds():
    assert jain_index([5, 5, 5]) == pytest.approx(1.0)
    assert jain_index([9, 0, 0]) == pytest.approx(1 / 3)
    assert jain_index([]) is None


def test_meets_targets_needs_success_and_both_targets():
    assert meets_targets(req("voice", 400, 90, 10), VOICE)
    assert not meets_targets(req("voice", 600, 90, 10), VOICE)
    assert not meets_targets(req("voice", 400, 120, 10), VOICE)
    assert not meets_targets(req("voice", 400, 90, 10, status="error"), VOICE)
    assert meets_targets(req("voice", 400, None, 1), VOICE)  # one token: TTFT only


def test_class_figures_and_weighted_fairness(tmp_path):
    db_engine, sessions = open_store(tmp_path)
    with sessions() as s:
        s.add_all([req("voice", 300, 50, 40), req("voice", 900, 50, 40), req("voice", 200, 80, 40),
                   req("voice", 250, 60, 40), req("chat", 1000, 100, 40), req("chat", 1000, 100, 0, status="error"),
                   req("chat", 100, 10, 999, minutes=90)])  # outside the window
        s.commit()
        figs = class_figures(s, {"voice": VOICE, "chat": CHAT}, T0, T0 + timedelta(hours=1))
    db_engine.dispose()
    by = {f.name: f for f in figs}
    assert (by["voice"].requests, by["voice"].met, by["voice"].slo_attainment) == (4, 3, 0.75)
    assert (by["chat"].requests, by["chat"].met, by["chat"].completion_tokens) == (2, 1, 40)
    # voice got 160 tokens at weight 4 (40 per unit), chat 40 at weight 1 (40 per unit): perfectly fair.
    assert fairness(figs) == pytest.approx(1.0)
