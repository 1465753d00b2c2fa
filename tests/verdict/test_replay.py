"""Scenarios, the summary over raw rows, the store round trip and Apply (no model needed)."""

import itertools
import json
import random
from datetime import UTC, datetime

import pytest
from sqlalchemy import select

from app.cli import build_parser
from app.policy import ClassPolicy
from app.store.db import open_store
from app.store.models import BenchApplied, Model, RequestClass, RunnerSettings
from app.verdict import sessions as store
from app.verdict.decide import HouseholdOverlap, Recommendation, Verdict
from app.verdict.results import RunResult, request_times, summarise
from app.verdict.scenarios import (
    PromptCutter,
    ScenarioError,
    arrivals,
    class_order,
    load_scenario,
    parse_scenario,
    plan,
    shipped_names,
)
from app.verdict.tables import format_table

POLICIES = {"voice": ClassPolicy("voice", priority=0, ttft_target_ms=500, tpot_target_ms=100, weight=4.0),
            "chat": ClassPolicy("chat", priority=1, ttft_target_ms=1500, tpot_target_ms=150, weight=2.0)}


def test_shipped_scenarios_load():
    assert {"household", "voice-under-background"} <= set(shipped_names())
    h = load_scenario("household")
    assert h.kind == "mix" and {c.name for c in h.classes} == {"voice", "chat", "documents", "coding", "background"}
    v = load_scenario("voice-under-background")
    assert v.kind == "script"
    bg, voice = v.streams
    assert (bg.class_name, bg.count, bg.prompt_tokens) == ("background", 4, (1500, 1500))
    assert (voice.class_name, voice.interval_s, voice.output_tokens) == ("voice", 0.4, (24, 24))


def test_user_scenario_file_and_errors(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('name = "mine"\n[arrival]\npattern = "poisson"\nrate_per_s = 4\n'
                 '[[classes]]\nname = "chat"\nprompt_tokens = [10, 20]\noutput_tokens = 8\n')
    s = load_scenario(str(f))
    assert s.pattern == "poisson" and s.classes[0].output_tokens == (8, 8)
    with pytest.raises(ScenarioError, match="unknown scenario 'nope'"):
        load_scenario("nope")
    with pytest.raises(ScenarioError, match="not found"):
        load_scenario(str(tmp_path / "missing.toml"))
    with pytest.raises(ScenarioError, match=r"classes\[0\].prompt_tokens"):
        parse_scenario({"name": "x", "classes": [{"name": "a", "prompt_tokens": [5, 1], "output_tokens": 2}]})
    with pytest.raises(ScenarioError, match="arrival.pattern"):
        parse_scenario({"name": "x", "arrival": {"pattern": "burst"}, "classes": []})
    with pytest.raises(ScenarioError, match="unknown text kind"):
        parse_scenario({"name": "x", "kind": "script", "streams": [{"class": "a", "text": "poem",
                                                                    "prompt_tokens": 3, "output_tokens": 3}]})


def test_class_order_is_proportional_and_mixed():
    h = load_scenario("household")
    assert [c.name for c in class_order(h.classes, 2)] == ["voice", "chat"]
    names = [c.name for c in class_order(h.classes, 9)]
    assert names.count("voice") == names.count("chat") and len(set(names)) == 5


def test_arrival_patterns():
    h = load_scenario("household")
    assert arrivals(h, 3, random.Random(1)) == [0.0, 0.0, 0.0]
    stag = parse_scenario({"name": "s", "arrival": {"pattern": "staggered", "stagger_ms": 250},
                           "classes": [{"name": "a", "prompt_tokens": 2, "output_tokens": 2}]})
    assert arrivals(stag, 3, random.Random(1)) == [0.0, 0.25, 0.5]
    poi = parse_scenario({"name": "p", "arrival": {"pattern": "poisson", "rate_per_s": 10},
                          "classes": [{"name": "a", "prompt_tokens": 2, "output_tokens": 2}]})
    a, b = arrivals(poi, 200, random.Random(3)), arrivals(poi, 200, random.Random(3))
    assert a == b and a[0] == 0.0 and all(y > x for x, y in itertools.pairwise(a))
    # Mean gap ≈ 1/rate.
    assert 0.07 < a[-1] / 199 < 0.13


def test_plan_is_deterministic_and_cuts_real_text_to_length():
    # A tokenizer of one token per word, so lengths can be checked exactly.
    words: dict[str, int] = {}
    rev: dict[int, str] = {}

    def tokenize(text):
        out = []
        for w in text.split():
            out.append(words.setdefault(w, len(words)))
            rev[words[w]] = w
        return out

    cutter = PromptCutter(tokenize, lambda toks: " ".join(rev[t] for t in toks))
    h = load_scenario("household")
    p1, p2 = plan(h, 4, cutter), plan(h, 4, cutter)
    assert p1 == p2 and len(p1) == 4
    for r in p1:
        cls = next(c for c in h.classes if c.name == r.class_name)
        assert cls.prompt_tokens[0] <= r.prompt_tokens <= cls.prompt_tokens[1]
        assert cls.output_tokens[0] <= r.max_tokens <= cls.output_tokens[1]
        assert len(tokenize(r.text)) == r.prompt_tokens
    v = plan(load_scenario("voice-under-background"), 99, cutter)
    assert len(v) == 14 and [r.class_name for r in v[:4]] == ["background"] * 4
    assert [round(r.at_s, 1) for r in v[4:]] == [round(0.4 * k, 1) for k in range(1, 11)]
    # Without a tokenizer the length is estimated from characters.
    assert PromptCutter().exact is False and len(PromptCutter().cut("voice", 20, 0)) == 80


def row(idx, cls, sent, first, end, n, status="ok"):
    return {"idx": idx, "class_name": cls, "priority": 0, "sent_s": sent, "first_token_s": first, "end_s": end,
            "prompt_tokens": 10, "completion_tokens": n, "max_tokens": n, "status": status,
            "error": None if status == "ok" else "boom", "server_timings": None}


ROWS = [row(0, "voice", 0.0, 0.2, 1.2, 11), row(1, "voice", 0.0, 0.4, 2.4, 21), row(2, "chat", 0.5, 2.5, 4.0, 16),
        row(3, "chat", 0.5, None, 0.9, 0, status="error")]
SAMPLES = [{"t_s": 0.2, "in_flight": 3, "util": 0.9, "kv_util": 0.1, "running": 2, "waiting": 1,
            "preemptions_total": 5},
           {"t_s": 0.4, "in_flight": 2, "util": 0.1, "kv_util": 0.3, "running": 2, "waiting": 0,
            "preemptions_total": 7},
           {"t_s": 0.6, "in_flight": 0, "util": 0.1, "kv_util": None, "running": 0, "waiting": 0,
            "preemptions_total": 7}]


def test_summary_from_raw_rows():
    s = summarise(ROWS, SAMPLES, POLICIES)
    assert s["wall_s"] == 4.0 and s["errors"] == 1 and s["ok"] == 3
    assert s["generated_tokens"] == 48 and s["gen_tok_s"] == 12.0 and s["prompt_tok_s"] == 30 / 4
    assert request_times(ROWS[0]) == pytest.approx({"ttft_ms": 200, "tpot_ms": 100, "completion_ms": 1200})
    assert s["ttft_p50_ms"] == pytest.approx(400) and s["ttft_p95_ms"] >= s["ttft_p50_ms"]
    v = s["per_class"]["voice"]
    assert v["ttft_p95_ms"] == pytest.approx(390) and v["slo_attainment"] == 1.0
    # chat: one ok request with TTFT 2000 ms > 1500 ms target, one failed.
    assert s["per_class"]["chat"]["slo_attainment"] == 0.0
    # Service / weight: voice 32/4 = 8, chat 16/2 = 8: perfectly fair.
    assert s["jain_fairness"] == pytest.approx(1.0)
    assert s["kv_mean_util"] == pytest.approx(0.2) and s["kv_peak_util"] == 0.3
    assert s["preemptions"] == 2 and s["peak_running"] == 2
    # One sample of three had requests in flight on an idle device.
    assert s["util_gap_share"] == pytest.approx(1 / 3)
    table = format_table([RunResult("serial", "hearth", 2, ROWS, SAMPLES, s, slots=4)])
    assert "voice" in table and "slots" in table.splitlines()[0] and "S=4" in table


def test_summary_without_server_metrics_says_na():
    s = summarise(ROWS[:1], [{"t_s": 0.1, "in_flight": 1, "util": 0.5}], POLICIES)
    assert s["kv_peak_util"] is None and s["preemptions"] is None
    assert "n/a" in format_table([RunResult("llama-server", "llama-server", 1, ROWS[:1], [], s)])


def test_store_round_trip_recomputes_the_live_summary(tmp_path):
    db_engine, sessions = open_store(tmp_path)
    live = RunResult("continuous", "hearth", 2, ROWS, SAMPLES, summarise(ROWS, SAMPLES, POLICIES), slots=16)
    with sessions() as s:
        sid = store.create_session(s, "household", "gemma", {"classes": {n: p.__dict__ for n, p in POLICIES.items()}})
        run_id = store.save_run(s, sid, live)
    with sessions() as s:
        (back,) = store.load_runs(s, sid)
    assert back.run_id == run_id == live.run_id
    assert back.requests == ROWS and back.slots == 16
    assert store.evidence([back])[0]["slots"] == 16
    assert back.summary == live.summary
    doc = json.loads(json.dumps(store.document("household", {}, None, [back], sid)))
    assert doc["summaries"][0]["summary"]["gen_tok_s"] == 12.0 and len(doc["raw"][0]["requests"]) == 4
    raw_csv = store.write_csv([back], tmp_path / "out.csv")
    assert (tmp_path / "out.csv").read_text().splitlines()[0].startswith("target,level")
    assert len(raw_csv.read_text().splitlines()) == 5
    db_engine.dispose()


def test_apply_updates_runner_settings_and_records_who(tmp_path):
    db_engine, sessions = open_store(tmp_path)
    verdict = Verdict(HouseholdOverlap(4, "default", "default", "no traffic"), 4, (
        Recommendation("continuous", "Use continuous", ("r",), {"gain": 1.5}, (1,), {"mode": "continuous"}),
        Recommendation("smaller_slots", "Fewer slots", ("r",), {}, (2,), {"parallel": 2}),
        Recommendation("insufficient", "No verdict", ("r",), {}, (), None),
        Recommendation("residency_first", "Pin", ("r",), {}, (), {"model": "gemma", "policy": "pinned"}),
    ))
    with sessions() as s:
        s.add(Model(name="gemma", source="default", policy="keep_alive"))
        s.commit()
        sid = store.create_session(s, "household", "gemma", {})
        store.finish_session(s, sid, verdict.as_dict())
        assert store.current_runner_settings(s, "gemma")["parallel"] == 8  # sized (no stored default)
        # Nothing has changed before Apply.
        assert s.scalar(select(RunnerSettings)) is None
        store.apply_recommendation(s, sid, 1, "admin")
        store.apply_recommendation(s, sid, 0, "admin")
        store.apply_recommendation(s, sid, 3, "root@cli")
        with pytest.raises(store.ApplyError, match="advice only"):
            store.apply_recommendation(s, sid, 2, "admin")
        with pytest.raises(store.ApplyError, match="no recommendation 9"):
            store.apply_recommendation(s, sid, 9, "admin")
    with sessions() as s:
        rs = s.scalar(select(RunnerSettings))
        assert (rs.parallel, rs.mode) == (2, "continuous")
        assert s.scalar(select(Model)).policy == "pinned"
        history = store.applied_history(s)
        assert [h.applied_by for h in history] == ["root@cli", "admin", "admin"]
        assert history[-1].changes == {"parallel": [None, 2]} and history[-1].session_id == sid
        assert history[0].changes == {"policy": ["keep_alive", "pinned"]}
        assert history[0].at <= datetime.now(UTC)
        assert s.query(BenchApplied).count() == 3
        assert store.current_runner_settings(s, "gemma") == {"parallel": 2, "n_batch": 512, "mode": "continuous"}
    db_engine.dispose()


def test_cli_arguments():
    args = build_parser().parse_args(["bench", "replay", "--levels", "1,2", "--modes", "serial", "--llama-server",
                                      "--json", "x.json"])
    assert args.levels == [1, 2] and args.modes == ["serial"] and args.llama_server == "auto"
    assert args.scenario == "household" and args.ctx == 8192 and args.parallel == 8 and args.slots is None
    assert build_parser().parse_args(["bench", "replay", "--slots", "4,8,16"]).slots == [4, 8, 16]
    assert build_parser().parse_args(["bench", "replay", "--modes", "none"]).modes == ["none"]
    assert build_parser().parse_args(["traffic"]).days == 7.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "replay", "--modes", "turbo"])


def test_comparison_against_the_reference_server():
    from app.verdict.tables import comparison, format_comparison

    ours = RunResult("continuous", "hearth", 2, ROWS, SAMPLES, summarise(ROWS, SAMPLES, POLICIES))
    slow = [dict(r, first_token_s=None if r["first_token_s"] is None else r["first_token_s"] * 10,
                 end_s=r["end_s"] * 2) for r in ROWS]
    theirs = RunResult("llama-server", "llama-server", 2, slow, [], summarise(slow, [], POLICIES))
    (row,) = comparison([ours, theirs])
    assert (row["mode"], row["reference"], row["level"]) == ("continuous", "llama-server", 2)
    assert row["gen_tok_s_ratio"] == pytest.approx(2.0)  # theirs took twice the wall time
    assert row["per_class"]["voice"]["ttft_p95_ratio"] == pytest.approx(0.1)
    assert row["per_class"]["voice"]["completion_max_ratio"] == pytest.approx(0.5)
    assert "voice: TTFT p95 0.100×" in format_comparison([row])
    assert comparison([ours]) == []


def test_cli_says_what_to_fix(tmp_path, monkeypatch, capsys):
    from app.cli import main

    monkeypatch.setenv("HEARTH_DATA", str(tmp_path / "data"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert main(["bench", "replay", "--modes", "none", "--model", str(model)]) == 2
    assert "nothing to measure" in capsys.readouterr().err
    assert main(["bench", "replay", "--scenario", "nope", "--model", str(model)]) == 2
    assert "unknown scenario 'nope'" in capsys.readouterr().err
    assert main(["traffic", "--days", "1"]) == 0
    assert "no requests or loads in the window" in capsys.readouterr().out


def test_repetitions_median_run_and_ratios_within_a_repetition(tmp_path):
    from app.verdict.results import median_runs
    from app.verdict.tables import comparison

    def scaled(target, rep, factor):
        rows = [dict(r, end_s=r["end_s"] * factor) for r in ROWS]
        return RunResult(target, "hearth", 2, rows, [], summarise(rows, [], POLICIES), rep=rep)

    runs = [scaled("continuous", 0, 1.0), scaled("llama-server", 0, 2.0),
            scaled("llama-server", 1, 4.0), scaled("continuous", 1, 1.0),
            scaled("continuous", 2, 3.0), scaled("llama-server", 2, 3.0)]
    (row,) = comparison(runs)
    assert row["repeats"] == 3 and row["gen_tok_s_ratios"] == pytest.approx([2.0, 4.0, 1.0])
    assert row["gen_tok_s_ratio"] == pytest.approx(2.0)
    med = {r.target: r for r in median_runs(runs)}
    assert med["continuous"].rep in (0, 1)  # the two fast ones tie; never the slow one
    assert med["llama-server"].rep == 2  # rates r/2, r/4, r/3: the median is r/3
    db_engine, sessions = open_store(tmp_path)
    with sessions() as s:
        sid = store.create_session(s, "x", None, {})
        for r in runs:
            store.save_run(s, sid, r)
        back = store.load_runs(s, sid, POLICIES)
    db_engine.dispose()
    assert [(r.target, r.rep) for r in back] == [(r.target, r.rep) for r in runs]


def test_a_serve_target_that_refuses_the_warm_up_is_a_clear_error():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from app.verdict.targets import Target, warm_up

    class Loading(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b'{"error": {"message": "the model is loading", "code": "loading"}}'
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Loading)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        target = Target("serve", f"http://127.0.0.1:{server.server_port}", "serve", "m", headers={"Authorization": "Bearer t"})
        with pytest.raises(RuntimeError, match="hearth serve did not answer the warm-up: HTTP 503: .*loading"):
            warm_up(target)
    finally:
        server.shutdown()
        server.server_close()


def test_apply_of_proposed_targets_writes_the_classes_and_refuses_a_gone_class(tmp_path):
    db_engine, sessions = open_store(tmp_path)
    verdict = Verdict(HouseholdOverlap(4, "default", "default", "no traffic"), 4, (
        Recommendation("targets", "Targets", ("r",), {}, (5,), {"classes": {"voice": {"tpot_target_ms": 230},
                                                                         "chat": {"ttft_target_ms": 1900}}}),
        Recommendation("targets", "Targets", ("r",), {}, (5,), {"classes": {"pets": {"tpot_target_ms": 230}}}),
    ))
    with sessions() as s:
        sid = store.create_session(s, "household", "gemma", {})
        store.finish_session(s, sid, verdict.as_dict())
        store.apply_recommendation(s, sid, 0, "admin")
        with pytest.raises(store.ApplyError, match="class 'pets' no longer exists"):
            store.apply_recommendation(s, sid, 1, "admin")
    with sessions() as s:
        voice, chat = s.get(RequestClass, "voice"), s.get(RequestClass, "chat")
        assert (voice.tpot_target_ms, voice.ttft_target_ms) == (230, 500)
        assert (chat.ttft_target_ms, chat.tpot_target_ms) == (1900, 150)
        (h,) = store.applied_history(s)
        assert h.changes == {"chat.ttft_target_ms": [1500, 1900], "voice.tpot_target_ms": [100, 230]}
    db_engine.dispose()


@pytest.mark.parametrize("bad", [{"tpot_target_ms": 0}, {"tpot_target_ms": "fast"}, {"tpot_target_ms": 12.5},
                                 {"tpot_target_ms": True}, {"name": 100}])
def test_apply_of_a_bad_target_value_names_it_and_writes_no_class(tmp_path, bad):
    db_engine, sessions = open_store(tmp_path)
    verdict = Verdict(HouseholdOverlap(4, "default", "default", "no traffic"), 4, (
        Recommendation("targets", "Targets", ("r",), {}, (5,), {"classes": {"chat": {"ttft_target_ms": 1900},
                                                                         "voice": bad}}),
        Recommendation("targets", "Targets", ("r",), {}, (5,), {"classes": {"coding": {"ttft_target_ms": 2500}}}),
    ))
    (field,) = bad
    with sessions() as s:
        sid = store.create_session(s, "household", "gemma", {})
        store.finish_session(s, sid, verdict.as_dict())
        with pytest.raises(store.ApplyError, match=f"voice.{field} = .* is not a target in whole milliseconds"):
            store.apply_recommendation(s, sid, 0, "admin")
        store.apply_recommendation(s, sid, 1, "admin")  # a later apply in the same session commits none of the refused one
    with sessions() as s:
        assert s.get(RequestClass, "chat").ttft_target_ms == 1500
        assert s.get(RequestClass, "voice").tpot_target_ms == 100
        assert s.get(RequestClass, "coding").ttft_target_ms == 2500
        (h,) = store.applied_history(s)
        assert h.changes == {"coding.ttft_target_ms": [2000, 2500]}
    db_engine.dispose()
