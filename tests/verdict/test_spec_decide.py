"""The speculative decoding finding on given results, its figures from raw rows, the store round trip and its Apply."""

import pytest
from sqlalchemy import select

from app.policy import ClassPolicy
from app.store.db import open_store
from app.store.models import BenchApplied, Model, RunnerSettings, utcnow
from app.verdict import sessions as store
from app.verdict.decide import Thresholds, decide, format_verdict, speculation
from app.verdict.results import RunResult, as_evidence, identity, summarise
from app.verdict.tables import format_spec, spec_rows

POLICIES = {"voice": ClassPolicy("voice", priority=0, ttft_target_ms=500, tpot_target_ms=100),
            "coding": ClassPolicy("coding", priority=2, ttft_target_ms=4000, tpot_target_ms=300),
            "chat": ClassPolicy("chat", priority=1, ttft_target_ms=1500, tpot_target_ms=150)}
T = Thresholds()
CODE = "def merge_intervals(intervals: list[list[int]]) -> list[list[int]]:\n    result = []\n"


def arm(target, level, tok_s, rep=0, acceptance=None, per_draft=None, outputs=None, voice_tpot=None, requests=1,
        slots=2, run_id=None):
    """A run row as the verdict reads it (app.verdict.results.as_evidence's shape)."""
    mode, _, spec = target.partition("+")
    per_class = {"coding": {"ttft_p95_ms": 900.0, "tpot_p95_ms": 30.0}}
    if voice_tpot is not None:
        per_class["voice"] = {"ttft_p95_ms": 200.0, "tpot_p95_ms": voice_tpot}
    return {"mode": mode, "spec": spec or None, "target": target, "level": level, "slots": slots, "rep": rep,
            "run_id": run_id if run_id is not None else abs(hash((target, level, rep))) % 100000,
            "summary": {"gen_tok_s": tok_s, "decode_tok_s": tok_s * 1.2, "requests": requests,
                        "spec_acceptance": acceptance, "spec_tokens_per_draft": per_draft,
                        "spec_draft_tokens": 100 if acceptance is not None else None,
                        "outputs": {"0": CODE} if outputs is None else outputs, "per_class": per_class}}


def one_stream(off_rates=(30.0, 31.0, 29.0), on_rates=(50.0, 52.0, 48.0), on_outputs=None, llama=True):
    """Three repetitions of code-edit: hearth off and ngram-lookup, and llama-server's arms."""
    runs = []
    for rep, (off, on) in enumerate(zip(off_rates, on_rates)):
        runs.append(arm("continuous+off", 1, off, rep))
        runs.append(arm("continuous+ngram-lookup", 1, on, rep, acceptance=0.85, per_draft=6.0, outputs=on_outputs))
        if llama:
            runs.append(arm("llama-server+off", 1, 35.0, rep))
            runs.append(arm("llama-server+ngram-mod", 1, 45.0, rep, acceptance=0.9, per_draft=20.0))
    return runs


def mix(off_rate=100.0, on_rate=99.0, on_voice_tpot=60.0, off_voice_tpot=55.0, target="serve"):
    """The household mix at 8 through serve: auto (its default) against off, two repetitions."""
    return [r for rep in range(2) for r in (
        arm(f"{target}+off", 8, off_rate, rep, voice_tpot=off_voice_tpot, requests=8, slots=8),
        arm(f"{target}+auto", 8, on_rate, rep, acceptance=0.4, per_draft=1.5, voice_tpot=on_voice_tpot, requests=8,
            slots=8))]


def kinds(v):
    return [r.kind for r in v.recommendations]


def test_one_stream_that_gains_with_identical_output_recommends_auto_and_says_why():
    runs = one_stream()
    rec = speculation(runs, POLICIES, T, {"speculation": "off"})
    assert rec.kind == "speculation_on" and rec.apply == {"speculation": "auto"}
    f = rec.numbers["one_stream"]["continuous+ngram-lookup"]
    assert f["ratio"] == pytest.approx(50 / 30) and f["repeats"] == 3 and f["acceptance"] == 0.85
    assert rec.numbers["llama_server_best"] == {"arm": "ngram-mod", "gen_tok_s": 45.0, "ratio": pytest.approx(50 / 45)}
    text = " ".join(rec.reasons)
    assert "byte-identical to continuous+off's (3 requests)" in text
    assert "1.67× (median of 3; threshold 1.10×" in text and "acceptance 85 %, 6.00 tokens per draft" in text
    assert "stock llama-server's best arm, ngram-mod: 45.0 tok/s; Hearth with ngram-lookup 1.11× of it" in text
    # The household mix was not measured: said so, and the run that would measure it is named.
    assert "the household mix was not measured" in text
    assert rec.measure == {"scenario": "household", "spec": ["off", "auto"], "levels": [8], "modes": [], "serve": True}
    # Hearth's off arm is compared with llama-server's (the oracle across servers), not counted against speculation.
    assert rec.numbers["identical"]["continuous+off"]["against"] == "llama-server+off"
    # The evidence is every run of the pairs, each once.
    assert len(rec.evidence) == len(set(rec.evidence)) == 6
    # Already auto: nothing to apply, the advice stands.
    assert speculation(runs, POLICIES, T, {}).apply is None


def test_a_one_stream_session_judges_speculation_alone():
    v = decide(one_stream(), POLICIES, T, None, {"parallel": 8, "n_batch": 512, "mode": "continuous"})
    assert kinds(v) == ["speculation_on"] and v.level is None
    out = format_verdict(v)
    assert "Use speculative decoding (auto): 1.67× on one stream of repetitive work" in out
    assert "measure: hearth bench replay --scenario household --levels 8 --modes none --spec off,auto --serve" in out


def test_a_changed_greedy_output_turns_it_off_whatever_the_gain():
    runs = one_stream(on_outputs={"0": CODE.replace("result = []", "result = list()")})
    rec = speculation(runs, POLICIES, T, {})
    assert rec.kind == "speculation_off" and rec.apply == {"speculation": "off"}
    assert rec.reasons[0].startswith("continuous+ngram-lookup's greedy output differs from continuous+off in 3 of 3 "
                                     "requests (first at character")
    assert rec.numbers["identical"]["continuous+ngram-lookup"]["differ"][0]["idx"] == 0


def _with_margin(runs, margin):
    """The drafting arm's runs with a near-tie note on request 0, as app.verdict.ties leaves it."""
    return [dict(r, summary={**r["summary"], "near_ties": {"0": margin}}) if r["target"] == "continuous+ngram-lookup"
            else r for r in runs]


def test_a_difference_at_a_near_tie_is_said_and_not_held_against_drafting():
    changed = one_stream(on_outputs={"0": CODE.replace("result = []", "result = list()")})
    rec = speculation(_with_margin(changed, 0.012), POLICIES, T, {"speculation": "off"})
    assert rec.kind == "speculation_on" and rec.apply == {"speculation": "auto"}
    line = next(r for r in rec.reasons if r.startswith("continuous+ngram-lookup's greedy output differs"))
    assert "each at a near-tie of the model's own choice (its two likeliest tokens there 0.012, 0.012, 0.012 nats" in line
    assert rec.numbers["identical"]["continuous+ngram-lookup"]["near_ties_only"] is True


@pytest.mark.parametrize("margin", [0.5, None])
def test_a_difference_with_a_clear_margin_or_none_measured_still_turns_it_off(margin):
    changed = one_stream(on_outputs={"0": CODE.replace("result = []", "result = list()")})
    rec = speculation(_with_margin(changed, margin), POLICIES, T, {})
    assert rec.kind == "speculation_off" and rec.apply == {"speculation": "off"}
    assert rec.numbers["identical"]["continuous+ngram-lookup"]["near_ties_only"] is False


def test_a_difference_where_the_off_arm_varies_itself_is_not_held_against_drafting():
    # At 8 at once the off arm's repetitions answer a request differently (batch composition): a drafting arm's
    # difference on that request is no evidence against drafting; one on a request off answers steadily is.
    other = CODE.replace("result = []", "result = list()")
    runs = [arm("serve+off", 8, 100.0, 0, outputs={"0": CODE, "1": CODE}, requests=2, slots=8),
            arm("serve+off", 8, 100.0, 1, outputs={"0": other, "1": CODE}, requests=2, slots=8),
            arm("serve+auto", 8, 110.0, 0, acceptance=0.5, per_draft=2.0, outputs={"0": other, "1": CODE}, requests=2,
                slots=8),
            arm("serve+auto", 8, 110.0, 1, acceptance=0.5, per_draft=2.0, outputs={"0": other, "1": CODE}, requests=2,
                slots=8)] + one_stream()
    rec = speculation(runs, POLICIES, T, {"speculation": "off"})
    assert rec.kind == "speculation_on"
    e = rec.numbers["identical"]["serve+auto"]
    assert e["explained"] and all(d["off_varies"] for d in e["differ"])
    assert any("the off arm's own repetitions answered 2 of these 2 requests in more than one way" in r
               for r in rec.reasons)
    steady = [dict(r, summary={**r["summary"], "outputs": {"0": CODE, "1": other}}) if r["target"] == "serve+auto"
              else r for r in runs]
    assert speculation(steady, POLICIES, T, {}).kind == "speculation_off"


def test_stock_llama_servers_changed_output_is_reported_not_held_against_hearth():
    runs = [dict(r, summary={**r["summary"], "outputs": {"0": CODE + "x"}}) if r["target"] == "llama-server+ngram-mod"
            else r for r in one_stream()]
    rec = speculation(runs, POLICIES, T, {"speculation": "off"})
    assert rec.kind == "speculation_on" and rec.apply == {"speculation": "auto"}
    assert any(r.startswith("llama-server+ngram-mod's greedy output differs from llama-server+off in 3 of 3")
               and r.endswith("; stock llama-server, for reference") for r in rec.reasons)
    changed = speculation(one_stream(on_outputs={"0": "x"}), POLICIES, T, {})
    assert changed.title == "Speculative decoding changed greedy output: turn it off"


def test_no_gain_on_one_stream_is_no_reason_to_keep_it():
    rec = speculation(one_stream(on_rates=(31.0, 31.5, 30.0)), POLICIES, T, {})
    assert rec.kind == "speculation_off" and "below the 1.10×" in rec.reasons[0]
    assert rec.title == "Speculative decoding does not pay here: turn it off"


def test_the_household_mix_must_keep_its_throughput_and_voice_its_tpot():
    good = speculation(one_stream() + mix(), POLICIES, T, {"speculation": "off"})
    assert good.kind == "speculation_on" and good.measure is None
    assert good.title.endswith(", the mix keeps 0.99×") and good.numbers["mix_level"] == 8
    assert any(r.startswith("household mix at 8 at once (serve): 99.0 tok/s with auto against 100.0 without: 0.99×")
               for r in good.reasons)
    assert any("voice keeps its TPOT target with auto: p95 60 ms ≤ 100 ms" in r for r in good.reasons)
    costly = speculation(one_stream() + mix(on_rate=95.0), POLICIES, T, {})
    assert costly.kind == "speculation_off" and "drafting costs the full batch" in costly.reasons[0]
    slow_voice = speculation(one_stream() + mix(on_voice_tpot=140.0), POLICIES, T, {})
    assert slow_voice.kind == "speculation_off"
    assert "voice's p95 TPOT is 140 ms with auto against its 100 ms target (55 ms without)" in slow_voice.reasons


def test_the_mix_is_judged_through_serve_when_serve_measured_it():
    runs = one_stream() + mix(target="serve") + mix(on_rate=90.0, target="continuous")
    rec = speculation(runs, POLICIES, T, {})
    assert set(rec.numbers["mix"]) == {"serve+auto"} and rec.kind == "speculation_on"


def test_the_mix_alone_leaves_speculation_unproven_and_names_the_one_stream_run():
    rec = speculation(mix(), POLICIES, T, {})
    assert rec.kind == "speculation_unproven" and rec.apply is None
    assert rec.measure["scenario"] == "code-edit" and rec.measure["spec"] == ["off", "ngram-lookup"]


def test_no_axis_no_finding_and_batching_is_judged_on_the_runs_without_drafts():
    assert speculation([arm("continuous", 1, 30.0)], POLICIES, T, {}) is None
    runs = [arm(f"{m}+{a}", lv, rate * (1.5 if a == "ngram-lookup" else 1.0), requests=lv, slots=8)
            for lv in (1, 2, 4) for m, rate in (("continuous", 40.0 * lv), ("serial", 30.0))
            for a in ("off", "ngram-lookup")]
    v = decide(runs, POLICIES, T, None, {"parallel": 8, "n_batch": 512, "mode": "continuous"})
    assert kinds(v)[0] == "continuous" and kinds(v)[-1] == "speculation_on"
    # The batching gain is continuous off over serial off at 4: 160 / 30.
    assert v.recommendations[0].numbers["gain"] == pytest.approx(160 / 30)


def _row(idx, timings, output, first=0.5, end=2.5, n=21):
    return {"idx": idx, "class_name": "coding", "priority": 2, "sent_s": 0.0, "first_token_s": first, "end_s": end,
            "prompt_tokens": 600, "completion_tokens": n, "max_tokens": n, "status": "ok", "error": None,
            "server_timings": timings, "output": output}


def test_drafting_figures_come_from_the_timings_and_the_counters_around_the_run():
    rows = [_row(0, {"draft_n": 40, "draft_n_accepted": 30}, CODE)]
    samples = [{"t_s": 0.0, "phase": "before", "spec_drafts_total": 10.0, "spec_draft_tokens_total": 90.0,
                "spec_accepted_total": 50.0},
               {"t_s": 1.0, "in_flight": 1, "util": 0.9, "kv_util": 0.2, "spec_drafts_total": 13.0},
               {"t_s": 2.6, "phase": "after", "spec_drafts_total": 15.0, "spec_draft_tokens_total": 130.0,
                "spec_accepted_total": 80.0}]
    s = summarise(rows, samples, POLICIES)
    assert (s["spec_draft_tokens"], s["spec_accepted_tokens"], s["spec_drafts"]) == (40, 30, 5)
    assert s["spec_acceptance"] == 0.75 and s["spec_tokens_per_draft"] == 6.0 and s["spec_requests_drafted"] == 1
    assert s["samples"] == 1 and s["kv_mean_util"] == 0.2  # the phase samples carry no load figures
    assert s["decode_tok_s"] == pytest.approx(20 / 2.0) and s["outputs"] == {"0": CODE}
    # A server whose timings say nothing: its counters over the run; one that drafted nothing: zero, not n/a.
    s = summarise([_row(0, {"predicted_n": 21}, CODE)], samples, POLICIES)
    assert (s["spec_draft_tokens"], s["spec_accepted_tokens"]) == (40, 30)
    flat = [dict(x, spec_draft_tokens_total=5.0, spec_accepted_total=1.0) for x in samples]
    s = summarise([_row(0, {"predicted_n": 21}, CODE)], flat, POLICIES)
    assert (s["spec_draft_tokens"], s["spec_acceptance"]) == (0, None)
    s = summarise([_row(0, None, CODE)], [], POLICIES)
    assert s["spec_draft_tokens"] is None and s["spec_drafts"] is None


def test_outputs_survive_the_store_and_the_tables_compare_them(tmp_path):
    db_engine, sessions = open_store(tmp_path)
    live = []
    for rep in range(2):
        for target, timings in (("continuous+off", {}), ("continuous+ngram-lookup", {"draft_n": 40, "draft_n_accepted": 36})):
            r = RunResult(target, "hearth", 1, [_row(0, timings, CODE, end=2.5 if "off" in target else 1.5)], [],
                          rep=rep, slots=2)
            r.summary = summarise(r.requests, r.samples, POLICIES)
            live.append(r)
    with sessions() as s:
        sid = store.create_session(s, "code-edit", "gemma", {})
        for r in live:
            store.save_run(s, sid, r)
        back = store.load_runs(s, sid, POLICIES)
        modes = [row.mode for row in s.scalars(select(store.BenchRun).order_by(store.BenchRun.id))]
    db_engine.dispose()
    assert modes == ["continuous"] * 4  # the label keeps the arm; mode is the target without it
    assert [r.requests[0]["output"] for r in back] == [CODE] * 4
    assert [r.summary for r in back] == [r.summary for r in live]
    assert identity(as_evidence(back)) == {"continuous+ngram-lookup": {
        "against": "continuous+off", "compared": 2, "identical": 2, "differ": [], "all_identical": True,
        "near_ties_only": False, "explained": False}}
    rows = {r["target"]: r for r in spec_rows(back)}
    on = rows["continuous+ngram-lookup"]
    assert on["ratio_to_off"] == pytest.approx(2.5 / 1.5) and on["acceptance"] == 0.9 and on["identical"] is True
    assert rows["continuous+off"]["ratio_to_off"] is None and rows["continuous+off"]["identical"] is None
    table = format_spec(list(rows.values()))
    assert "continuous+ngram-lookup" in table and "yes 2/2" in table and "90%" in table


def test_apply_sets_the_models_speculation_and_records_it(tmp_path):
    db_engine, sessions = open_store(tmp_path)
    verdict = decide(one_stream(), POLICIES, T, None, {"speculation": "off"})
    off = speculation(one_stream(on_rates=(30.0, 30.0, 30.0)), POLICIES, T, {})
    doc = verdict.as_dict()
    doc["recommendations"].append(off.as_dict())
    with sessions() as s:
        s.add(Model(name="gemma", source="default", first_seen_at=utcnow(), last_seen_at=utcnow()))
        s.commit()
        sid = store.create_session(s, "code-edit", "gemma", {})
        store.finish_session(s, sid, doc)
        row = store.apply_recommendation(s, sid, 0, "admin")
        assert row.changes == {"speculation": [None, "auto"]}
        assert s.scalar(select(RunnerSettings)).speculation == "auto"
        assert store.current_runner_settings(s, "gemma")["speculation"] == "auto"
        store.apply_recommendation(s, sid, 1, "admin")
        assert s.scalar(select(RunnerSettings)).speculation == "off"
        assert [h.changes for h in store.applied_history(s)] == [{"speculation": ["auto", "off"]},
                                                                 {"speculation": [None, "auto"]}]
        assert s.query(BenchApplied).count() == 2
    db_engine.dispose()
