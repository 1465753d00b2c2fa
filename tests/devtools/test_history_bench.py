"""`hearth bench history` at a tiny size: both stores are built with the real schema and rollups, pages are timed."""

import json
from datetime import UTC, datetime

import numpy as np
from sqlalchemy import text

from app.cli import main
from app.devtools.serving.history_bench import (
    DAY_S,
    HistoryConfig,
    _minute_rows,
    build_store,
    day_values,
    series_keys,
)
from app.store.db import open_store


def test_series_and_synthetic_day_are_deterministic():
    cfg = HistoryConfig(runners=2, gpus=1)
    keys = series_keys(cfg)
    assert len(keys) == 3 + 5 + 2 * 7 and len(set(keys)) == len(keys)
    a = day_values(cfg, ("runner:gemma-3-270m-q4_k_m@local", "gen_tok_s"), 0, 0)
    assert a.shape == (DAY_S,) and np.array_equal(a, day_values(cfg, ("runner:gemma-3-270m-q4_k_m@local", "gen_tok_s"), 0, 0))
    assert 0.05 < (a > 0).mean() < 0.3  # idle most of the day, as a household is
    rows = _minute_rows(7, 600, np.arange(120, dtype=float))
    assert rows == [(7, 600, 0.0, 59.0, float(sum(range(60))), 60), (7, 660, 60.0, 119.0, float(sum(range(60, 120))), 60)]


def test_size_store_keeps_seconds_only_for_the_retention_window(tmp_path):
    cfg = HistoryConfig(runners=1, gpus=0, requests=300, end=datetime(2026, 11, 29, 12, 0, tzinfo=UTC))
    out = build_store(tmp_path, cfg, sample_days=1 / 24, history_days=0.25, progress=False)
    n_series = len(series_keys(cfg))
    assert out["rows"]["samples"] == n_series * 3600
    assert out["rows"]["rollups_1m"] == n_series * 6 * 60  # direct minute rows + rolled-up ones, no gap or overlap
    assert out["rows"]["rollups_1h"] == n_series * 6 and out["rows"]["requests"] == 300
    assert out["bytes"] > 0
    engine, sessions = open_store(tmp_path)
    with sessions() as s:
        # The rolled-up minute of the sample window equals its seconds.
        got = s.execute(text(
            "SELECT r.sum, (SELECT sum(value) FROM samples x WHERE x.series_id = r.series_id AND x.at >= r.bucket"
            " AND x.at < r.bucket + 60) FROM rollups_1m r WHERE r.bucket = (SELECT max(bucket) FROM rollups_1m) LIMIT 3"
        )).all()
    engine.dispose()
    assert got and all(a == b for a, b in got)


def test_command_builds_times_pages_and_writes_json(tmp_path, monkeypatch, standin_model, capsys):
    monkeypatch.setenv("HEARTH_DEFAULT_MODEL", str(standin_model))
    out = tmp_path / "history.json"
    assert main(["bench", "history", "--days", "0.05", "--size-days", "0.1", "--retention-h", "1", "--runners", "1",
                 "--gpus", "0", "--requests", "400", "--repeat", "2", "--quiet", "--data", str(tmp_path / "stores"),
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "held constant:" in printed and "size store:" in printed
    result = json.loads(out.read_text())
    pages = result["pages"]
    for label in ("overview", "models", "classes 7 d", "requests", "requests member=guest (rare)", "members"):
        assert pages[label]["status"] == 200, label
        assert pages[label]["median_ms"] > 0
    assert any(k.startswith("chart ") for k in pages) and all(p["status"] == 200 for p in pages.values())
    assert "requests page 2 (keyset)" in pages
    assert result["size_store"]["rows"]["requests"] == 400 and result["timing_store"]["bytes"] > 0
