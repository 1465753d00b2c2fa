"""A draft model on the embedded GGUF (--spec-type draft-simple, -md): the first 6 of Gemma's 18 blocks
(app/devtools/draft_gguf.py) draft, the whole model verifies; greedy, the text is the one drafting off gives
(per request, "speculative.n_max": 0), limits and stop strings are exact, the drafts are counted. Gemma drafting
for itself is kept nearly always; a draft of another vocabulary is refused at load."""

from __future__ import annotations

import pytest

from app.devtools.draft_gguf import cached_draft
from app.devtools.engine.spec_bench import PROMPT
from app.devtools.gguf_shapes import SHAPES, make_model
from app.engine.model_config import ModelConfig
from app.engine.speculation import SpecConfig
from app.runner.app import create_app
from app.runner.config import RunnerConfig
from tests.runner.loaded import loaded_runner
from tests.runner.streams import loads, payloads

# Drafting every iteration (as llama-server): on this CPU a draft model never pays, so the cost rule would stand aside.
SPEC = SpecConfig(type="draft-simple", n_max=4, draft_by_cost=False)


def config(target, draft, spec=SPEC) -> RunnerConfig:
    """A 2-slot runner of target with draft as its draft model."""
    def load(path):
        return ModelConfig(path=str(path), n_ctx=2048, n_seq_max=2, n_threads=2,
                           n_outputs_extra=spec.draft_max if path == target else 0)
    return RunnerConfig(load(target), spec=spec, draft_model=load(draft), metrics=True)


@pytest.fixture(scope="module")
def runner(gemma_path):
    with loaded_runner(config(gemma_path, cached_draft(gemma_path, 6))) as client:
        yield client


def completion(runner, **extra) -> dict:
    body = {"prompt": PROMPT, "n_predict": 64, "temperature": 0, "cache_prompt": False, **extra}
    return loads(runner.post("/completion", json=body))


def test_the_draft_model_drafts_and_the_text_is_unchanged(runner):
    off = completion(runner, **{"speculative.n_max": 0})
    on = completion(runner)
    assert on["content"] == off["content"]
    assert on["tokens_predicted"] == off["tokens_predicted"] == 64
    assert "draft_n" not in off["timings"]
    assert on["timings"]["draft_n"] > 0
    assert 0 < on["timings"]["draft_n_accepted"] < on["timings"]["draft_n"]  # a real smaller model errs sometimes


def test_streamed_and_whole_answers_agree(runner):
    whole = completion(runner)
    events = payloads(runner.post("/completion", json={"prompt": PROMPT, "n_predict": 64, "temperature": 0,
                                                       "cache_prompt": False, "stream": True}))
    assert "".join(e.get("content", "") for e in events) == whole["content"]
    assert events[-1]["timings"]["predicted_n"] == whole["timings"]["predicted_n"]


def test_stop_strings_and_limits_are_exact(runner):
    # A stop string from the middle of the answer: drafts run past it, the answer must end before it.
    full = completion(runner, n_predict=40, **{"speculative.n_max": 0})["content"]
    stop = full[len(full) // 2: len(full) // 2 + 4]
    off = completion(runner, n_predict=40, stop=[stop], **{"speculative.n_max": 0})
    on = completion(runner, n_predict=40, stop=[stop])
    assert off["content"] == full[: full.index(stop)]
    assert on["content"] == off["content"] and on["stop_type"] == off["stop_type"] == "word"
    for n in (1, 2, 7):
        short = completion(runner, n_predict=n)
        assert short["tokens_predicted"] == n
        assert short["content"] == completion(runner, n_predict=n, **{"speculative.n_max": 0})["content"]


def test_metrics_and_props_report_the_draft_model(runner, gemma_path):
    completion(runner)
    text = runner.get("/metrics").get_data(as_text=True)
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["llamacpp:spec_decode_num_drafts_total"] > 0
    assert 0 < values["llamacpp:spec_decode_num_accepted_tokens_total"] < values[
        "llamacpp:spec_decode_num_draft_tokens_total"]
    props = loads(runner.get("/props"))["speculative"]
    assert props["enabled"] and props["type"] == "draft-simple" and props["n_max"] == 4
    draft = props["draft_model"]
    assert draft["path"] == str(cached_draft(gemma_path, 6)) and draft["name"].endswith(".gguf")
    assert draft["calls"] > 0 and draft["cost_measured"]
    assert 0 < draft["size_ratio"] < 1


def test_the_model_drafting_for_itself_is_kept_nearly_always(gemma_path):
    with loaded_runner(config(gemma_path, gemma_path)) as client:
        off = completion(client, **{"speculative.n_max": 0})
        on = completion(client, n_predict=96)
    assert on["content"].startswith(off["content"])
    t = on["timings"]
    assert t["draft_n"] > 0
    # Only batch-versus-one-token rounding can make a draft of the same weights differ from the verification.
    assert t["draft_n_accepted"] >= 0.9 * t["draft_n"]


def test_a_draft_of_another_vocabulary_is_refused_at_load(gemma_path, tmp_path):
    other = tmp_path / "tiny-random.gguf"
    make_model(SHAPES["tiny"], other)
    app = create_app(config(gemma_path, other), load=False)
    app.state.load()
    try:
        assert app.state.status == "error"
        message = app.state.error
        assert str(other) in message and str(gemma_path) in message
        assert "vocabular" in message
    finally:
        if app.state.model is not None:
            app.state.model.close()
