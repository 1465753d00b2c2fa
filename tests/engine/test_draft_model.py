"""Draft-model speculative decoding (app/engine/draft_model.py): a second fake model drafts, the target verifies in its
one batch; the draft's KV is kept level lazily and its cost counts in whether to draft."""

import pytest
from fake_model import FakeClock, FakeModel

from app.engine.draft_model import DraftModel, vocab_mismatch
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from app.engine.speculation import SpecConfig
from tests.engine.test_speculation import collect

TIMEOUT_S = 10.0
EOS = 2
BODY = list(range(10, 70))
PROMPT = [1, *BODY, 5, *BODY[:6]]
SCRIPT = BODY[6:] + [EOS]
ALWAYS = SpecConfig(type="draft-simple", n_max=4, draft_by_cost=False)


def pair(scripts, n_ctx=512, n_batch=128, draft_step_s=0.001, draft_kw=None, **dm_kw):
    """A target and a draft fake on one clock, and the DraftModel over the draft (timed by that clock)."""
    clock = FakeClock()
    target = FakeModel(n_ctx=n_ctx, n_batch=n_batch, n_seq_max=4, scripts=scripts, clock=clock)
    draft = FakeModel(n_ctx=n_ctx, n_batch=n_batch, n_seq_max=4, scripts=scripts, clock=clock,
                      decode_step_s=draft_step_s, **(draft_kw or {}))
    return target, draft, DraftModel(draft, clock=clock, **dm_kw)


def run(spec, prompts=(PROMPT,), script=SCRIPT, max_tokens=100, stop=(), rule=None, draft_kw=None, **dm_kw):
    """Requests through a fresh engine with a draft model; returns (outputs, finishes, target, draft fake, dm, engine)."""
    target, draft, dm = pair({tuple(p): script for p in prompts}, draft_kw=draft_kw, **dm_kw)
    draft.draft_rule = rule
    engine = Engine(target, clock=target.clock, spec=spec, draft_model=dm if spec.uses_draft_model else None)
    requests = [engine.submit(list(p), SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop))
                for p in prompts]
    engine.start()
    try:
        results = [collect(r) for r in requests]
    finally:
        engine.stop()
    assert target.violations == [] and draft.violations == []
    assert engine.scheduler.cache.check() == []
    return [t for t, _ in results], [f for _, f in results], target, draft, dm, engine


def assert_level(dm, draft):
    """The draft's per-slot record is exactly what its model's KV holds."""
    for slot in range(draft.n_seq_max):
        assert dm.held.get(slot, []) == draft.tokens_of(slot), slot


def test_a_perfect_draft_is_kept_whole_and_needs_fewer_target_decodes():
    (plain,), _, t0, *_ = run(SpecConfig())
    (out,), (fin,), t1, draft, dm, engine = run(ALWAYS)
    assert out == plain == BODY[6:]
    c = engine.counters
    assert c.spec_draft_tokens_total > 0
    assert c.spec_accepted_tokens_total == c.spec_draft_tokens_total
    assert len(t1.batches) < len(t0.batches) / 3  # up to 4 drafted + 1 per target decode
    assert fin.stats.num_draft_tokens == c.spec_draft_tokens_total
    # The "draft" source learnt that it is always right.
    assert engine.scheduler.spec_stats["draft"].p > 0.9
    # One draft decode per draft step, each with one token per drafting sequence.
    assert all(len(b) == 1 for b in draft.batches)


def test_wrong_draft_tokens_are_rejected_and_the_draft_catches_up_lazily():
    wrong = {20, 33, 34, 50}

    def rule(history):
        nxt = SCRIPT[len(history) - len(PROMPT)] if len(history) >= len(PROMPT) else 11
        return (99 if nxt in wrong else nxt), 1.0

    (out,), _, target, draft, dm, engine = run(ALWAYS, rule=rule)
    assert out == BODY[6:]
    c = engine.counters
    assert 0 < c.spec_accepted_tokens_total < c.spec_draft_tokens_total
    # Rejected cells leave the draft's KV by seq_rm from the first wrong position, never from 0 mid-answer.
    removed = [op for op in draft.kv_ops if op[0] == "rm"]
    assert removed[-1] == ("rm", 0, 0, -1)  # the engine's stop frees the draft's cells too
    assert removed[:-1] and all(op[2] > len(PROMPT) for op in removed[:-1])
    assert_level(dm, draft)


def test_a_reused_slot_keeps_the_common_prefix_of_the_draft_cells():
    target, draft, dm = pair({tuple(PROMPT): SCRIPT, tuple(PROMPT[:40] + [7, 8, 9]): [11, 12, 13, EOS]})
    engine = Engine(target, clock=target.clock, spec=ALWAYS, draft_model=dm).start()
    try:
        first, _ = collect(engine.submit(PROMPT, SamplingParams(max_tokens=20, temperature=0.0)))
        second, _ = collect(engine.submit(PROMPT[:40] + [7, 8, 9], SamplingParams(max_tokens=20, temperature=0.0)))
    finally:
        engine.stop()
    assert first == BODY[6:26] and second == [11, 12, 13]
    assert target.violations == [] and draft.violations == []
    # The second request's draft kept the first 40 cells of the first one's (same slot, same prefix).
    cuts = [op for op in draft.kv_ops if op[0] == "rm" and op[1] == 0]
    assert ("rm", 0, 40, -1) in cuts


def test_p_min_stops_drafts_the_draft_model_is_unsure_of():
    def unsure(history):
        nxt = SCRIPT[len(history) - len(PROMPT)] if len(history) >= len(PROMPT) else 11
        return nxt, 0.3

    (out,), _, _, _, dm, engine = run(SpecConfig(type="draft-simple", n_max=4, draft_by_cost=False, p_min=0.5),
                                      rule=unsure, p_min=0.5)
    assert out == BODY[6:]
    assert engine.counters.spec_draft_tokens_total == 0
    assert dm.num_calls_total > 0
    (out,), _, _, _, _, engine = run(ALWAYS, rule=unsure, p_min=0.2)
    assert engine.counters.spec_draft_tokens_total > 0


def test_drafts_shorter_than_n_min_are_dropped():
    # The draft stops after one token each time (an end token next): n_min 2 drops every proposal.
    def short(history):
        return (EOS, 1.0) if (len(history) - len(PROMPT)) % 2 else (SCRIPT[len(history) - len(PROMPT)], 1.0)

    (out,), *_, engine = run(SpecConfig(type="draft-simple", n_max=4, n_min=2, draft_by_cost=False), rule=short)
    assert out == BODY[6:]
    assert engine.counters.spec_draft_tokens_total == 0


def test_a_draft_model_slower_than_the_target_stands_aside():
    # Target decodes take 10 ms, draft steps 20 ms: a draft token costs more than a target iteration yields.
    spec = SpecConfig(type="draft-simple", n_max=4)
    (out,), _, _, draft, dm, engine = run(spec, draft_step_s=0.02, size_ratio=2.0)
    assert out == BODY[6:]
    assert engine.counters.spec_draft_tokens_total == 0
    assert "not worth" in engine.scheduler.spec_note
    # A fast one (1 ms a step) drafts under the same policy.
    (out,), _, _, _, dm, engine = run(spec, draft_step_s=0.001, size_ratio=0.1)
    assert out == BODY[6:]
    assert engine.counters.spec_draft_tokens_total > 0
    assert dm.measured and dm.cost.iteration_ms(1, 0) < 3


def test_the_draft_models_time_is_not_charged_to_the_target():
    (_,), _, _, _, _, engine = run(ALWAYS, draft_step_s=0.05)
    # Target decodes take 10 ms whatever the draft spends: the fit of the target's iterations stays near that.
    assert engine.scheduler.cost.iteration_ms(1, 0) < 20


def test_several_sequences_draft_in_the_same_draft_decodes():
    prompts = [[1 + i, *BODY, 5, *BODY[:6]] for i in range(2)]
    outs, _, _, draft, dm, engine = run(SpecConfig(type="draft-simple", n_max=8, draft_by_cost=False),
                                        prompts=prompts, script=BODY[6:40] + [EOS])
    assert outs == [BODY[6:40]] * 2
    assert any(len(b) == 2 and all(len(e.tokens) == 1 for e in b) for b in draft.batches)
    assert_level(dm, draft)


def test_max_tokens_and_stop_strings_are_exact_with_a_draft_model():
    for limit in (1, 2, 5, 9):
        (out,), (fin,), *_ = run(ALWAYS, max_tokens=limit)
        assert out == BODY[6 : 6 + limit]
        assert fin.finish_reason == "length"
    (out,), (fin,), *_ = run(ALWAYS, stop=("<30>",))
    assert fin.finish_reason == "stop" and out == BODY[6 : BODY.index(30) + 1]


def test_a_long_prompt_catches_up_in_n_batch_pieces_before_drafting():
    long_prompt = [1, *range(100, 400), 5, *BODY[:6]]  # 308 tokens, n_batch 128
    (out,), _, _, draft, dm, engine = run(ALWAYS, prompts=(long_prompt,), script=BODY[6:30] + [EOS])
    assert out == BODY[6:30]
    assert max(sum(len(e.tokens) for e in b) for b in draft.batches) <= 128
    assert engine.counters.spec_draft_tokens_total > 0
    assert_level(dm, draft)


def test_a_full_draft_cache_drops_its_records_and_the_output_is_unchanged():
    # The draft's cache holds 60 cells: the 67-token prompt never fits, so every draft decode is refused.
    (out,), *_, draft, dm, engine = run(ALWAYS, draft_kw={"kv_capacity": 60})
    assert out == BODY[6:]
    assert dm.num_failed_total > 0 and engine.counters.spec_draft_tokens_total == 0
    assert_level(dm, draft)


def test_a_request_can_turn_the_draft_model_off():
    target, draft, dm = pair({tuple(PROMPT): SCRIPT})
    engine = Engine(target, clock=target.clock, spec=ALWAYS, draft_model=dm).start()
    try:
        out, _ = collect(engine.submit(PROMPT, SamplingParams(max_tokens=100, temperature=0.0, speculative_n_max=0)))
    finally:
        engine.stop()
    assert out == BODY[6:]
    assert dm.num_calls_total == 0 and draft.batches == []


def test_draft_simple_needs_a_draft_model():
    with pytest.raises(ValueError, match="-md"):
        Engine(FakeModel(), spec=ALWAYS)


class Vocab:
    """vocab_facts / vocab_texts of a made-up vocabulary."""

    def __init__(self, texts, **facts):
        self.texts = texts
        self.facts = {"type": 1, "add_bos": True, "bos": 2, "add_eos": False, "eos": 1, "n_vocab": len(texts), **facts}

    def vocab_facts(self):
        return self.facts

    def vocab_texts(self, start, end):
        return self.texts[start:end]


def test_the_vocabulary_check_is_llama_cpps():
    texts = [f"t{i}".encode() for i in range(1000)]
    assert vocab_mismatch(Vocab(texts), Vocab(list(texts))) is None
    # The first five ids are not compared; a few tokens more or less are allowed.
    assert vocab_mismatch(Vocab(texts), Vocab([b"x"] * 5 + texts[5:])) is None
    assert vocab_mismatch(Vocab(texts), Vocab(texts[:950], n_vocab=950)) is None
    assert "sizes differ" in vocab_mismatch(Vocab(texts), Vocab(texts[:800], n_vocab=800))
    other = list(texts)
    other[321] = b"zz"
    assert "token 321" in vocab_mismatch(Vocab(texts), Vocab(other))
    assert "types differ" in vocab_mismatch(Vocab(texts), Vocab(texts, type=2))
    assert "BOS" in vocab_mismatch(Vocab(texts), Vocab(texts, bos=3))
    assert "EOS" in vocab_mismatch(Vocab(texts, add_eos=True), Vocab(texts, add_eos=True, eos=7))
    assert vocab_mismatch(Vocab(texts), Vocab(texts, eos=7)) is None  # not added: not compared, as llama.cpp
