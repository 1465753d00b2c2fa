"""End-to-end replay against real runners (Gemma 3 270M) in each mode: results must hang together."""

import itertools
import json

import pytest

from app.cli import main
from app.store.db import open_store
from app.store.models import BenchRequest, BenchRun, BenchSession
from app.verdict import sessions as store
from app.verdict.replay import BenchConfig, run_bench
from app.verdict.results import request_times

TINY = """
name = "tiny"
description = "two classes, short prompts, a few tokens each"
kind = "mix"
[arrival]
pattern = "all_at_once"
[[classes]]
name = "voice"
text = "voice"
prompt_tokens = [10, 16]
output_tokens = [6, 8]
[[classes]]
name = "chat"
text = "chat"
prompt_tokens = [20, 30]
output_tokens = [6, 8]
"""


@pytest.fixture(scope="module")
def bench(gemma_path, tmp_path_factory):
    """One session: levels 1, 2 and 4 on continuous, serial and static runners of 2 slots (4 for level 4)."""
    data = tmp_path_factory.mktemp("bench-data")
    scenario = data / "tiny.toml"
    scenario.write_text(TINY)
    db_engine, sessions = open_store(data)
    seen = []
    cfg = BenchConfig(scenario=str(scenario), levels=(1, 2, 4), model_path=str(gemma_path), n_ctx=1024, parallel=2,
                      n_batch=256, threads=2)
    outcome = run_bench(cfg, sessions, progress=lambda run, done, total: seen.append((done, total)))
    yield outcome, sessions, seen
    db_engine.dispose()


def test_every_mode_and_level_ran_with_progress(bench):
    outcome, _, seen = bench
    assert [(r.target, r.level, r.slots) for r in outcome.runs] == [
        (m, lv, 2 if lv <= 2 else 4) for lv in (1, 2, 4) for m in ("continuous", "serial", "static")]
    assert seen == [(i, 9) for i in range(1, 10)]
    c = outcome.constants
    assert (c["n_ctx"], c["parallel"], c["n_batch"], c["threads"]) == (1024, 2, 256, 2)
    # Level 4 ran on runners with 4 slots and as many KV cells per slot.
    assert [(g["slots"], g["n_ctx"], g["levels"]) for g in c["runner_plan"]["groups"]] == [
        (2, 1024, [1, 2]), (4, 2048, [4])]
    assert c["model_sha256"] and c["prompt_lengths"].startswith("exact") and c["machine"]["cores"] >= 1


def test_results_are_internally_consistent(bench):
    outcome, _, _ = bench
    for run in outcome.runs:
        s = run.summary
        assert s["errors"] == 0 and s["requests"] == run.level
        wall = max(r["end_s"] for r in run.requests) - min(r["sent_s"] for r in run.requests)
        tokens = sum(r["completion_tokens"] for r in run.requests)
        assert s["generated_tokens"] == tokens and s["gen_tok_s"] == pytest.approx(tokens / wall)
        # ignore_eos: every request generates exactly what it asked for, as the server counted it.
        for r in run.requests:
            assert r["completion_tokens"] == r["max_tokens"] == r["server_timings"]["num_completion_tokens"]
            t = request_times(r)
            assert 0 < t["ttft_ms"] <= t["completion_ms"]
            # The client sees at least what the engine measured from the request's arrival there.
            assert r["server_timings"]["total_ms"] <= t["completion_ms"] + 1
        for key in ("ttft", "tpot", "completion"):
            if s[f"{key}_p50_ms"] is not None:
                assert s[f"{key}_p95_ms"] >= s[f"{key}_p50_ms"]
        assert s["kv_peak_util"] is None or 0 <= s["kv_mean_util"] <= s["kv_peak_util"] <= 1
        assert s["preemptions"] in (0, None)


def test_serial_never_runs_two_requests_in_the_engine_at_once(bench):
    outcome, _, _ = bench
    for run in (r for r in outcome.runs if r.target == "serial"):
        assert run.summary["peak_running"] in (None, 0, 1)
        # Engine-side running intervals (from arrival + queue to arrival + total), in client time.
        spans = sorted((r["sent_s"] + r["server_timings"]["queue_ms"] / 1000,
                        r["sent_s"] + r["server_timings"]["total_ms"] / 1000) for r in run.requests)
        for (_, end_a), (start_b, _) in itertools.pairwise(spans):
            assert start_b >= end_a - 0.05  # tolerance: the HTTP hop from client to engine
    # Continuous runs the two requests of level 2 together (static may not: a request arriving a
    # moment after the batch closed waits for the next batch).
    for run in (r for r in outcome.runs if r.level == 2 and r.target == "continuous"):
        spans = sorted((r["sent_s"] + r["server_timings"]["queue_ms"] / 1000,
                        r["sent_s"] + r["server_timings"]["total_ms"] / 1000) for r in run.requests)
        assert spans[1][0] < spans[0][1]


def test_stored_raw_rows_recompute_the_live_summaries_and_the_verdict_links_them(bench):
    outcome, sessions, _ = bench
    with sessions() as s:
        back = store.load_runs(s, outcome.session_id)
        row = s.get(BenchSession, outcome.session_id)
        assert row.status == "done"
        assert s.query(BenchRequest).join(BenchRun).filter(BenchRun.session_id == outcome.session_id).count() == 21
        stored_verdict = row.verdict
    assert [b.summary for b in back] == [r.summary for r in outcome.runs]
    assert stored_verdict == json.loads(json.dumps(outcome.verdict.as_dict()))
    run_ids = {r.run_id for r in outcome.runs}
    # An empty request log: judged at the default overlap (4), which this session measured.
    assert (stored_verdict["household_overlap"], stored_verdict["statistic"], stored_verdict["level"]) == (
        4, "default", 4)
    rec = stored_verdict["recommendations"][0]
    assert rec["kind"] in ("continuous", "serial", "smaller_budget") and set(rec["evidence"]) <= run_ids
    assert {r.level for r in outcome.runs if r.run_id in rec["evidence"]} == {4}


def test_cli_replay_sweeps_slots_and_writes_json_and_csv(gemma_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HEARTH_DATA", str(tmp_path / "data"))
    (tmp_path / "tiny.toml").write_text(TINY)
    rc = main(["bench", "replay", "--scenario", str(tmp_path / "tiny.toml"), "--levels", "2", "--slots", "1,2",
               "--modes", "continuous,serial", "--model", str(gemma_path), "--ctx", "512", "--parallel", "2",
               "--batch", "128", "--threads", "2", "--json", str(tmp_path / "out.json"),
               "--csv", str(tmp_path / "out.csv")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "held constant" in out and "verdict" in out and "household overlap" in out
    assert "1 slots, 256 KV cells: levels [2], modes continuous, serial" in out
    assert "2 slots, 512 KV cells: levels [2], modes continuous" in out
    doc = json.loads((tmp_path / "out.json").read_text())
    # Serial runs one request at a time whatever its slots: measured once.
    assert [(s["mode"], s["level"], s["slots"]) for s in doc["summaries"]] == [
        ("continuous", 2, 1), ("serial", 2, 1), ("continuous", 2, 2)]
    assert doc["constants"]["n_ctx"] == 512
    # Level 2, below the default overlap of 4: no verdict, and the run that would give one.
    rec = doc["verdict"]["recommendations"][0]
    assert rec["kind"] == "not_enough_evidence" and rec["measure"] == {"levels": [1, 2, 4],
                                                                     "modes": ["continuous", "serial"]}
    assert "--levels 1,2,4 --modes continuous,serial" in out
    assert [len(r["requests"]) for r in doc["raw"]] == [2, 2, 2]
    assert (tmp_path / "out-requests.csv").read_text().count("\n") == 7


def test_cli_replay_through_hearth_serve_with_its_default_settings(gemma_path, tmp_path, monkeypatch, capsys):
    # `--serve`: a fresh `hearth serve` (default settings, the runner it sizes itself) measured beside a
    # runner, every request through the gateway with its class named; the gateway gives each its class's priority.
    monkeypatch.setenv("HEARTH_DATA", str(tmp_path / "data"))
    (tmp_path / "tiny.toml").write_text(TINY)
    rc = main(["bench", "replay", "--scenario", str(tmp_path / "tiny.toml"), "--levels", "2", "--modes", "continuous",
               "--serve", "--model", str(gemma_path), "--ctx", "1024", "--parallel", "2", "--threads", "2",
               "--json", str(tmp_path / "out.json")])
    assert rc == 0
    doc = json.loads((tmp_path / "out.json").read_text())
    summaries = {r["mode"]: r for r in doc["summaries"]}
    raw = {r["mode"]: r for r in doc["raw"]}
    assert set(summaries) == {"continuous", "serve"} and doc["constants"]["serve"] is True
    assert summaries["serve"]["slots"] == 8  # serve sized its runner (8 slots on a CPU), not the bench's --parallel
    assert summaries["serve"]["summary"]["errors"] == 0 and summaries["serve"]["summary"]["requests"] == 2
    priorities = {"voice": 0, "chat": 1}  # the shipped classes', set by the gateway, not by the client
    for r in raw["serve"]["requests"]:
        assert r["server_timings"]["priority"] == priorities[r["class_name"]]
        assert r["completion_tokens"] == r["max_tokens"]
        t = request_times(r)
        # The client's stopwatch covers what the runner measured behind the gateway.
        assert r["server_timings"]["ttft_ms"] <= t["ttft_ms"] + 1
        assert r["server_timings"]["total_ms"] <= t["completion_ms"] + 1
    assert "serve" in capsys.readouterr().out
