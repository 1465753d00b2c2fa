"""Speculative decoding on the embedded GGUF: a runner started with --spec-type ngram-lookup gives, greedy, exactly
the text it gives with drafting off (per request, "speculative.n_max": 0), and says what it drafted."""

from __future__ import annotations

import pytest

from app.devtools.engine.spec_bench import PROMPT
from app.engine.model_config import ModelConfig
from app.engine.speculation import SpecConfig
from app.protocols import sse
from app.runner.config import RunnerConfig
from tests.runner.loaded import loaded_runner
from tests.runner.streams import loads, payloads

SPEC = SpecConfig(type="ngram-lookup")


@pytest.fixture(scope="module")
def runner(gemma_path):
    cfg = RunnerConfig(ModelConfig(path=str(gemma_path), n_ctx=2048, n_seq_max=2, n_threads=2,
                                   n_outputs_extra=SPEC.draft_max), spec=SPEC, metrics=True)
    with loaded_runner(cfg) as client:
        yield client


def completion(runner, **extra) -> dict:
    body = {"prompt": PROMPT, "n_predict": 96, "temperature": 0, "cache_prompt": False, **extra}
    return loads(runner.post("/completion", json=body))


def test_copying_is_drafted_and_the_text_is_unchanged(runner):
    off = completion(runner, **{"speculative.n_max": 0})
    on = completion(runner)
    assert on["content"] == off["content"]
    assert on["tokens_predicted"] == off["tokens_predicted"]
    assert "draft_n" not in off["timings"]
    assert on["timings"]["draft_n"] > 0
    assert 0 < on["timings"]["draft_n_accepted"] <= on["timings"]["draft_n"]


def test_streamed_drafts_give_the_same_text_and_token_count(runner):
    whole = completion(runner)
    events = payloads(runner.post("/completion", json={"prompt": PROMPT, "n_predict": 96, "temperature": 0,
                                                       "cache_prompt": False, "stream": True}))
    assert "".join(e.get("content", "") for e in events) == whole["content"]
    assert events[-1]["timings"]["predicted_n"] == whole["timings"]["predicted_n"]


def test_a_verified_burst_goes_out_in_one_write(runner):
    # The WSGI body's items are the socket writes: a draft kept whole is many tokens in one iteration, written
    # together (app.runner.generation.joined), each token still an event of its own.
    body = {"prompt": PROMPT, "n_predict": 96, "temperature": 0, "cache_prompt": False, "stream": True}
    resp = runner.post("/completion", json=body, buffered=False)
    writes = [bytes(w) for w in resp.response]
    resp.close()
    events = [ev.json() for ev in sse.events([b"".join(writes)])]
    tokens = [e for e in events if e.get("content")]
    assert events[-1]["timings"]["draft_n_accepted"] > 0
    assert all(w.endswith(b"\n\n") for w in writes), "a write ends with a whole event"
    # Without the joining every token was a write of its own (and the final event one more).
    assert len(writes) < len(tokens) - events[-1]["timings"]["draft_n_accepted"] // 2


def test_stop_string_and_limit_are_exact_under_drafting(runner):
    off = completion(runner, n_predict=40, stop=["return"], **{"speculative.n_max": 0})
    on = completion(runner, n_predict=40, stop=["return"])
    assert on["content"] == off["content"]
    assert on["stop_type"] == off["stop_type"]
    short_off = completion(runner, n_predict=7, **{"speculative.n_max": 0})
    short_on = completion(runner, n_predict=7)
    assert short_on["content"] == short_off["content"]
    assert short_on["tokens_predicted"] == 7


def test_a_grammar_holds_for_drafted_tokens(runner):
    grammar = 'root ::= "def " [a-z_]+ "(" [a-z, ]* "):" [\\x00-\\x7f]*'
    off = completion(runner, grammar=grammar, n_predict=48, **{"speculative.n_max": 0})
    on = completion(runner, grammar=grammar, n_predict=48)
    assert on["content"] == off["content"]
    assert on["content"].startswith("def ")


def test_sampled_output_with_a_seed_is_unchanged(runner):
    # Sampling and comparing is the acceptance rule for a one-token proposal: one random draw per output token,
    # so a seeded run draws the same numbers with or without drafts.
    off = completion(runner, temperature=0.7, seed=11, **{"speculative.n_max": 0})
    on = completion(runner, temperature=0.7, seed=11)
    assert on["content"] == off["content"]


def test_metrics_and_props_report_the_drafts(runner):
    completion(runner)
    text = runner.get("/metrics").get_data(as_text=True)
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["llamacpp:spec_decode_num_draft_tokens_total"] > 0
    assert 0 < values["llamacpp:spec_decode_num_accepted_tokens_total"] <= values[
        "llamacpp:spec_decode_num_draft_tokens_total"]
    assert values["llamacpp:spec_decode_num_drafts_total"] > 0
    assert values['hearth:spec_draft_tokens_by_class_total{class="default"}'] > 0
    props = loads(runner.get("/props"))["speculative"]
    assert props["enabled"] and props["type"] == "ngram-lookup"
    assert props["by_class"]["default"]["accepted_tokens"] > 0
    # The cost rule's record per source: what it decided, and why in words, in /props; the counts in /metrics.
    sources = props["sources"]
    assert sources and all(src["last"]["why"] for src in sources.values())
    drafted = sum(src["decisions"]["draft"] + src["decisions"]["explore"] for src in sources.values())
    assert drafted > 0
    assert sum(v for k, v in values.items() if k.startswith("hearth:spec_source_decisions_total{")
               and ('decision="draft"' in k or 'decision="explore"' in k)) == drafted
    assert props["verify_ms_by_tokens"]  # the measured prices the rule weighed
