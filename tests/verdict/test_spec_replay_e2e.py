"""A short real replay of code-edit through two hearth runners (speculation off and ngram-lookup), Gemma 3 270M."""

import pytest

from app.store.db import open_store
from app.verdict import sessions as store
from app.verdict.replay import BenchConfig, run_bench
from app.verdict.scenarios import load_scenario

SHORT = """
name = "code-edit-short"
description = "code-edit's prompt, 24 tokens"
kind = "script"
[bench]
modes = ["continuous"]
spec = ["off", "ngram-lookup"]
[[streams]]
class = "coding"
text = "code-edit"
count = 1
output_tokens = [24, 24]
"""


@pytest.fixture(scope="module")
def outcome(gemma_path, tmp_path_factory):
    data = tmp_path_factory.mktemp("spec-bench")
    (data / "short.toml").write_text(SHORT)
    scenario = load_scenario(str(data / "short.toml"))
    db_engine, sessions = open_store(data)
    cfg = BenchConfig(scenario=str(data / "short.toml"), modes=scenario.modes, spec=scenario.spec,
                      model_path=str(gemma_path), n_ctx=1024, parallel=1, n_batch=256, threads=2)
    out = run_bench(cfg, sessions)
    yield out, sessions
    db_engine.dispose()


def test_both_arms_answer_the_same_greedy_text_and_only_the_lookup_arm_drafts(outcome):
    out, _ = outcome
    runs = {r.target: r for r in out.runs}
    assert set(runs) == {"continuous+off", "continuous+ngram-lookup"}
    off, on = runs["continuous+off"], runs["continuous+ngram-lookup"]
    for r in (off, on):
        assert r.summary["errors"] == 0 and r.requests[0]["completion_tokens"] == 24
        assert r.requests[0]["prompt_tokens"] > 400  # the whole function list
    assert on.requests[0]["output"] == off.requests[0]["output"] and off.requests[0]["output"]
    # The lookup arm drafted from the prompt it copies; off drafted nothing.
    assert on.summary["spec_draft_tokens"] > 0 and on.summary["spec_drafts"] > 0
    assert 0 <= on.summary["spec_accepted_tokens"] <= on.summary["spec_draft_tokens"]
    assert on.requests[0]["server_timings"]["draft_n"] == on.summary["spec_draft_tokens"]
    assert off.summary["spec_draft_tokens"] == 0 and "draft_n" not in off.requests[0]["server_timings"]
    assert out.constants["spec"] == ["off", "ngram-lookup"]
    assert out.constants["runner_plan"]["groups"][0]["spec"] == ["off", "ngram-lookup"]


def test_the_stored_session_keeps_the_outputs_and_judges_speculation_alone(outcome):
    out, sessions = outcome
    (rec,) = out.verdict.recommendations
    assert rec.kind in ("speculation_on", "speculation_off")
    ident = rec.numbers["identical"]["continuous+ngram-lookup"]
    assert ident["all_identical"] and ident["compared"] == 1
    with sessions() as s:
        back = {r.target: r for r in store.load_runs(s, out.session_id)}
    assert back["continuous+ngram-lookup"].requests[0]["output"] == back["continuous+off"].requests[0]["output"]
    assert back["continuous+off"].requests[0]["output"] == next(r for r in out.runs if r.target == "continuous+off").requests[0]["output"]
    assert back["continuous+ngram-lookup"].summary == next(r.summary for r in out.runs
                                                          if r.target == "continuous+ngram-lookup")
