"""The reasoning budget in the engine (llama-server's --reasoning-budget) and special tokens rendered for the parser."""

import pytest

from app.engine.engine import Engine
from app.engine.reasoning_budget import BudgetTracker, Phase, ReasoningBudget, ends_whole_character
from app.engine.request import Delta, Finished, SamplingParams
from tests.engine.fake_model import FakeModel

START, END = 50, 51  # the thought's markers (special tokens)
THOUGHT, ANSWER = 11, (20, 21)
MESSAGE = (30, 31)
PROMPT = [1, 5, 6, 7]


class Thinker(FakeModel):
    """A model that opens a thought, would think forever, and answers two tokens once the thought is closed."""

    def next_token(self, prompt, history):
        """START first; THOUGHT while a thought is open; after the end, the answer, then EOS."""
        opened = max((i for i, t in enumerate(history) if t == START), default=-1)
        closed = max((i for i, t in enumerate(history) if t == END), default=-1)
        if opened > closed:
            return THOUGHT
        if closed < 0:
            return START
        after = len(history) - 1 - closed
        return ANSWER[after] if after < len(ANSWER) else self.eos_token


def run(model, prompt=PROMPT, **params):
    """One request to completion: (generated tokens, text, Finished)."""
    engine = Engine(model, mode="serial").start()
    try:
        r = engine.submit(prompt, SamplingParams(temperature=0.0, **params))
        text, fin = "", None
        for ev in engine.events(r):
            if isinstance(ev, Delta):
                text += ev.text
            elif isinstance(ev, Finished):
                fin = ev
        return list(fin.output_tokens), text, fin
    finally:
        engine.stop()
        assert not model.violations


def budget(n, **kw):
    """Budget spec with the Thinker's markers."""
    return ReasoningBudget(start=(START,), end=(END,), budget=n, **kw)


def test_without_a_budget_the_thinker_thinks_until_max_tokens():
    tokens, _, fin = run(Thinker(), max_tokens=8)
    assert tokens == [START] + [THOUGHT] * 7
    assert fin.finish_reason == "length" and fin.num_reasoning_tokens == 0  # no markers named: not counted


def test_an_unlimited_budget_only_counts_the_thoughts_tokens():
    tokens, _, fin = run(Thinker(), max_tokens=8, reasoning_budget=budget(-1))
    assert tokens == [START] + [THOUGHT] * 7
    assert fin.num_reasoning_tokens == 8


def test_a_spent_budget_forces_the_end_marker_and_the_answer_follows():
    model = Thinker()
    tokens, _, fin = run(model, max_tokens=32, reasoning_budget=budget(3))
    assert tokens == [START, THOUGHT, THOUGHT, THOUGHT, END, *ANSWER]
    assert model.forced == [END]
    assert fin.finish_reason == "stop"
    assert fin.num_reasoning_tokens == 5  # START, three thought tokens, the forced END


def test_the_message_is_forced_before_the_end_marker():
    model = Thinker()
    tokens, text, _ = run(model, max_tokens=32, reasoning_budget=budget(2, message=MESSAGE))
    assert tokens == [START, THOUGHT, THOUGHT, *MESSAGE, END, *ANSWER]
    assert model.forced == [*MESSAGE, END]
    # Forced tokens are text like any other token.
    assert text == "".join(f"<{t}>" for t in tokens)


def test_budget_zero_in_a_thought_the_prompt_opened_ends_it_at_once():
    model = Thinker()
    tokens, _, fin = run(model, prompt=[*PROMPT, START], max_tokens=32, reasoning_budget=budget(0, in_thought=True))
    assert tokens == [END, *ANSWER]
    assert fin.num_reasoning_tokens == 1


def test_budget_zero_ends_a_thought_the_model_opens_itself():
    tokens, _, _ = run(Thinker(), max_tokens=32, reasoning_budget=budget(0))
    assert tokens == [START, END, *ANSWER]


def test_a_forced_token_the_grammar_refuses_leaves_the_sequence_to_the_sampler():
    model = Thinker(refuse_forced=frozenset({END}))
    tokens, _, fin = run(model, max_tokens=6, reasoning_budget=budget(2))
    assert tokens == [START] + [THOUGHT] * 5
    assert model.forced == [] and fin.finish_reason == "length"


def test_a_thought_ended_by_the_model_within_budget_is_not_forced():
    class ShortThinker(Thinker):
        def next_token(self, prompt, history):
            if history[-3:] == (START, THOUGHT, THOUGHT):
                return END
            return super().next_token(prompt, history)

    model = ShortThinker()
    tokens, _, fin = run(model, max_tokens=32, reasoning_budget=budget(10))
    assert tokens == [START, THOUGHT, THOUGHT, END, *ANSWER]
    assert model.forced == [] and fin.num_reasoning_tokens == 4


def test_special_tokens_render_their_markup_only_when_the_request_names_them():
    specials = {START: b"<think>", END: b"</think>"}
    _, hidden, _ = run(Thinker(specials=specials), max_tokens=32, reasoning_budget=budget(1))
    _, shown, _ = run(Thinker(specials=specials), max_tokens=32, reasoning_budget=budget(1),
                      special_ids=frozenset(specials))
    assert hidden == "<11><20><21>"
    assert shown == "<think><11></think><20><21>"


def test_several_sequences_keep_their_own_budgets():
    model = Thinker(n_seq_max=2)
    engine = Engine(model).start()
    try:
        short = engine.submit(PROMPT, SamplingParams(temperature=0.0, max_tokens=32, reasoning_budget=budget(1)))
        long = engine.submit([1, 9, 9], SamplingParams(temperature=0.0, max_tokens=32, reasoning_budget=budget(4)))
        outs = {}
        for r in (short, long):
            outs[r.request_id] = next(ev for ev in engine.events(r) if isinstance(ev, Finished)).output_tokens
    finally:
        engine.stop()
    assert list(outs[short.request_id]) == [START, THOUGHT, END, *ANSWER]
    assert list(outs[long.request_id]) == [START, *[THOUGHT] * 4, END, *ANSWER]
    assert not model.violations


# -- the tracker alone ---------------------------------------------------------------------------


def feed(tracker, tokens, pieces=None):
    """Accept tokens (with their bytes), taking the forced one whenever the tracker names one."""
    out = []
    for t in tokens:
        forced = tracker.next_forced()
        token = forced if forced is not None else t
        tracker.accept(token, (pieces or {}).get(token, b"x"))
        out.append(token)
    return out


def test_multi_token_markers_are_matched_across_tokens():
    tracker = BudgetTracker(ReasoningBudget(start=(7, 8), end=(9, 10), budget=2))
    out = feed(tracker, [7, 8, 1, 2, 3, 3, 3, 4])
    assert out == [7, 8, 1, 2, 9, 10, 3, 4]
    assert tracker.phase is Phase.OUTSIDE


def test_half_a_start_marker_opens_nothing():
    tracker = BudgetTracker(ReasoningBudget(start=(7, 8), end=(9,), budget=1))
    feed(tracker, [7, 1, 8, 1, 1])
    assert tracker.phase is Phase.OUTSIDE and tracker.num_thought_tokens == 0


def test_the_end_waits_for_a_character_split_across_tokens():
    # Token 1 holds the first two bytes of "你" (e4 bd a0), token 2 the last one.
    pieces = {1: b"\xe4\xbd", 2: b"\xa0", 3: b"a"}
    tracker = BudgetTracker(ReasoningBudget(start=(5,), end=(9,), budget=1, in_thought=True))
    out = feed(tracker, [1, 2, 3, 3], pieces)
    assert out == [1, 2, 9, 3]


def test_a_new_thought_gets_a_fresh_budget():
    tracker = BudgetTracker(ReasoningBudget(start=(5,), end=(9,), budget=1))
    out = feed(tracker, [5, 1, 1, 2, 5, 1, 1, 2])
    assert out == [5, 1, 9, 2, 5, 1, 9, 2]
    assert tracker.num_thought_tokens == 6


@pytest.mark.parametrize("piece, whole", [
    (b"a", True), (b"\xe4\xbd\xa0", True), (b"\xe4\xbd", False), (b"\xa0", True), (b"ab\xc3", False),
    (b"\xf0\x9f\x98\x80", True), (b"", True),
])
def test_utf8_boundaries(piece, whole):
    assert ends_whole_character(piece) is whole


def test_a_budget_needs_both_markers_and_a_sane_size():
    with pytest.raises(ValueError, match="markers"):
        ReasoningBudget(start=(), end=(1,))
    with pytest.raises(ValueError, match="-1"):
        ReasoningBudget(start=(1,), end=(2,), budget=-2)


# -- the real model ------------------------------------------------------------------------------


def test_the_embedded_gguf_ends_a_thought_through_its_grammar_when_the_budget_is_spent(gemma_path):
    from app.engine.grammar import client_grammar
    from app.engine.llama_model import LlamaModel
    from app.engine.model_config import ModelConfig

    model = LlamaModel(ModelConfig(path=str(gemma_path), n_ctx=512, n_seq_max=1, n_batch=128, n_threads=2))
    engine = Engine(model, mode="serial").start()
    try:
        end = tuple(model.tokenize("</think>", add_special=False, parse_special=True))
        start = tuple(model.tokenize("<think>", add_special=False, parse_special=True))
        prompt = model.tokenize("Think about the sea.<think>", add_special=True, parse_special=True)
        # The grammar would let the thought run to max_tokens; only the budget ends it.
        grammar = client_grammar('root ::= [a-z ]+ "</think>" "ok"')
        params = SamplingParams(temperature=0.0, max_tokens=40, grammar=grammar,
                                reasoning_budget=ReasoningBudget(start=start, end=end, budget=3, in_thought=True))
        r = engine.submit(prompt, params)
        text, fin = "", None
        for ev in engine.events(r):
            if isinstance(ev, Delta):
                text += ev.text
            elif isinstance(ev, Finished):
                fin = ev
    finally:
        engine.stop()
        model.close()
    out = list(fin.output_tokens)
    assert out[3:3 + len(end)] == list(end), (text, out)
    assert text.endswith("</think>ok") and fin.finish_reason == "stop"
    assert fin.num_reasoning_tokens == 3 + len(end)
