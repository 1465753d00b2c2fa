"""Tests for app.engine.engine: the engine thread driven end to end by a fake model (no llama.cpp)."""

import logging
import queue
import threading

import pytest
from fake_model import FakeModel

from app.engine.engine import Engine
from app.engine.request import (
    ContextOverflow,
    Delta,
    Finished,
    QueueFull,
    Request,
    RequestStatus,
    SamplingParams,
)
from app.policy import SloTargets

EOS = 2
IGNORE_EOS_TOKEN = 3
TIMEOUT_S = 10.0


@pytest.fixture
def make_engine():
    """Builds engines on fake models and stops every one of them after the test."""
    engines: list[Engine] = []

    def factory(model: FakeModel, **kwargs) -> Engine:
        engine = Engine(model, clock=model.clock, **kwargs)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.stop()
        assert engine._thread is None or not engine._thread.is_alive()


def prompt(tag: int, n: int = 4) -> list[int]:
    """A prompt whose first token identifies it."""
    return [tag] + [200 + i for i in range(n - 1)]


def collect(request: Request, timeout_s: float = TIMEOUT_S) -> tuple[list[Delta], Finished]:
    """All of a request's events up to and including Finished."""
    deltas: list[Delta] = []
    while True:
        ev = request.events.get(timeout=timeout_s)
        if isinstance(ev, Finished):
            assert request.events.empty(), "nothing may follow Finished"
            return deltas, ev
        deltas.append(ev)


def text_of(deltas: list[Delta]) -> str:
    """The streamed text."""
    return "".join(d.text for d in deltas)


def layout(model: FakeModel, ids: dict[int, str]) -> list[list[tuple[str, int, int, bool]]]:
    """Accepted batches as (request name, start position, number of tokens, wants logits)."""
    return [[(ids[e.request_id], e.start_pos, len(e.tokens), e.want_logits) for e in b] for b in model.batches]


def run_all(engine: Engine, requests: list[Request]) -> dict[int, tuple[list[Delta], Finished]]:
    """Start the engine and wait for every request to finish."""
    engine.start()
    return {r.request_id: collect(r) for r in requests}


def only_cache_left(engine: Engine, model: FakeModel) -> bool:
    """No running sequence holds a cell; whatever the model still holds is the prefix cache's."""
    return engine.scheduler.kv_used == 0 and model.kv_used == engine.scheduler.kv_cached


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    """Deterministic settings: the fake model ignores temperature anyway, the engine does not."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


# -- basics ------------------------------------------------------------------------------------


def test_one_request_streams_its_tokens_and_ends_with_length(make_engine):
    model = FakeModel()
    engine = make_engine(model)
    r = engine.submit(prompt(1), greedy(5, ignore_eos=True))
    deltas, fin = run_all(engine, [r])[r.request_id]
    expected = model.expected_tokens(prompt(1), 5)
    assert r.output_tokens == expected
    assert [d.num_tokens for d in deltas] == [1] * 5
    assert text_of(deltas) == "".join(f"<{t}>" for t in expected)
    assert fin.finish_reason == "length" and fin.error is None
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert fin.stats.num_prompt_tokens == 4 and fin.stats.num_completion_tokens == 5
    assert model.violations == []
    assert model.live_samplers == 0
    assert only_cache_left(engine, model)
    assert r.slot is None and r.sampler is None


def test_eos_ends_with_stop_and_is_not_streamed(make_engine):
    model = FakeModel(scripts={tuple(prompt(1)): [40, 41, 42]}, pieces={40: b"a", 41: b"b", 42: b"c"})
    engine = make_engine(model)
    r = engine.submit(prompt(1), greedy(10))
    deltas, fin = run_all(engine, [r])[r.request_id]
    assert fin.finish_reason == "stop"
    assert r.output_tokens == [40, 41, 42]  # EOS ends the answer without being part of it
    assert EOS not in r.output_tokens
    assert text_of(deltas) == "abc"
    assert sum(d.num_tokens for d in deltas) == 3
    assert fin.stats.num_completion_tokens == 3
    # Prefill plus three decodes, the last of which produced EOS.
    assert len(model.batches) == 4


def test_ignore_eos_runs_to_max_tokens(make_engine):
    model = FakeModel(scripts={tuple(prompt(1)): [40, 41, 42]}, pieces={40: b"a", 41: b"b", 42: b"c", 3: b"."})
    engine = make_engine(model)
    r = engine.submit(prompt(1), greedy(5, ignore_eos=True))
    deltas, fin = run_all(engine, [r])[r.request_id]
    assert fin.finish_reason == "length"
    assert r.output_tokens == [40, 41, 42, IGNORE_EOS_TOKEN, IGNORE_EOS_TOKEN]
    assert text_of(deltas) == "abc.."


def test_eos_as_first_token_gives_an_empty_answer(make_engine):
    model = FakeModel(scripts={tuple(prompt(1)): []})
    engine = make_engine(model)
    r = engine.submit(prompt(1), greedy(10))
    deltas, fin = run_all(engine, [r])[r.request_id]
    assert deltas == []
    assert fin.finish_reason == "stop"
    assert fin.stats.num_completion_tokens == 0
    assert fin.stats.ttft_ms is not None and fin.stats.tpot_ms is None


# -- text: stop strings and UTF-8 ---------------------------------------------------------------

HELLO = {20: b"Hel", 21: b"lo W", 22: b"or", 23: b"ld", 24: b"!"}


def test_stop_string_across_tokens_is_cut_and_not_streamed(make_engine):
    model = FakeModel(scripts={tuple(prompt(1)): [20, 21, 22, 23, 24]}, pieces=HELLO)
    engine = make_engine(model)
    r = engine.submit(prompt(1), greedy(10, stop=("World",)))
    deltas, fin = run_all(engine, [r])[r.request_id]
    assert [d.text for d in deltas] == ["Hel", "lo ", "", ""]
    assert [d.num_tokens for d in deltas] == [1, 1, 1, 1]
    assert fin.finish_reason == "stop"
    assert fin.stats.num_completion_tokens == 4
    assert r.output_tokens == [20, 21, 22, 23]


def test_held_back_stop_prefix_is_released_when_it_does_not_complete(make_engine):
    model = FakeModel(scripts={tuple(prompt(1)): [20, 21, 22, 23, 24]}, pieces=HELLO)
    engine = make_engine(model)
    r = engine.submit(prompt(1), greedy(5, stop=("Wz", "!!")))
    deltas, fin = run_all(engine, [r])[r.request_id]
    assert text_of(deltas) == "Hello World!"
    # "!" might start "!!": it is held back and only released by the length finish.
    assert deltas[-1] == Delta("!", 0)
    assert fin.finish_reason == "length"


def test_earliest_of_several_stop_strings_wins(make_engine):
    model = FakeModel(scripts={tuple(prompt(1)): [20, 21, 22, 23, 24]}, pieces=HELLO)
    engine = make_engine(model)
    r = engine.submit(prompt(1), greedy(10, stop=("World!", "lo")))
    deltas, fin = run_all(engine, [r])[r.request_id]
    assert text_of(deltas) == "Hel"
    assert fin.finish_reason == "stop"
    assert r.output_tokens == [20, 21]


def test_multibyte_characters_split_across_tokens_stream_whole(make_engine):
    euro, fire = "€".encode(), "🔥".encode()
    pieces = {30: b"caf", 31: b"\xc3", 32: b"\xa9 ", 33: euro[:1], 34: euro[1:]}
    pieces |= {35: fire[:2], 36: fire[2:3], 37: fire[3:]}
    model = FakeModel(scripts={tuple(prompt(1)): [30, 31, 32, 33, 34, 35, 36, 37]}, pieces=pieces)
    engine = make_engine(model)
    r = engine.submit(prompt(1), greedy(20))
    deltas, fin = run_all(engine, [r])[r.request_id]
    assert [d.text for d in deltas] == ["caf", "", "é ", "", "€", "", "", "🔥"]
    assert all("\ufffd" not in d.text for d in deltas)
    assert fin.finish_reason == "stop"
    assert fin.stats.num_completion_tokens == 8


def test_stop_string_made_of_a_split_multibyte_character(make_engine):
    euro = "€".encode()
    pieces = {30: b"5 ", 33: euro[:1], 34: euro[1:2], 35: euro[2:] + b" tail"}
    model = FakeModel(scripts={tuple(prompt(1)): [30, 33, 34, 35]}, pieces=pieces)
    engine = make_engine(model)
    r = engine.submit(prompt(1), greedy(20, stop=("€",)))
    deltas, fin = run_all(engine, [r])[r.request_id]
    assert text_of(deltas) == "5 "
    assert fin.finish_reason == "stop"
    assert len(deltas) == 4


def test_incomplete_character_at_the_end_becomes_a_replacement_character(make_engine):
    model = FakeModel(scripts={tuple(prompt(1)): [30, 31]}, pieces={30: b"caf", 31: b"\xc3"})
    engine = make_engine(model)
    r = engine.submit(prompt(1), greedy(20))
    deltas, fin = run_all(engine, [r])[r.request_id]
    assert [d.text for d in deltas] == ["caf", "", "\ufffd"]
    assert deltas[-1].num_tokens == 0
    assert fin.finish_reason == "stop"


# -- submission errors --------------------------------------------------------------------------


def test_prompt_too_long_for_the_context_raises_at_submit(make_engine):
    model = FakeModel(n_ctx=32)
    engine = make_engine(model)
    with pytest.raises(ContextOverflow) as info:
        engine.submit(prompt(1, 32), greedy(4))
    assert (info.value.num_prompt_tokens, info.value.n_ctx) == (32, 32)
    assert model.live_samplers == 0
    assert engine.counters.requests_total == 0
    assert not engine.scheduler.has_work


def test_prompt_of_n_ctx_minus_one_gets_exactly_one_token(make_engine):
    model = FakeModel(n_ctx=32, n_batch=32)
    engine = make_engine(model)
    r = engine.submit(prompt(1, 31), greedy(10, ignore_eos=True))
    deltas, fin = run_all(engine, [r])[r.request_id]
    assert fin.finish_reason == "length"
    assert len(deltas) == 1 and len(r.output_tokens) == 1
    assert model.violations == []


def test_queue_full_when_max_waiting_reached(make_engine):
    model = FakeModel()
    engine = make_engine(model, max_waiting=2)
    first = [engine.submit(prompt(i), greedy(2)) for i in (1, 2)]
    with pytest.raises(QueueFull) as info:
        engine.submit(prompt(3), greedy(2))
    assert info.value.max_waiting == 2
    assert model.live_samplers == 2  # the refused request's sampler was freed
    assert engine.counters.requests_total == 2
    results = run_all(engine, first)
    assert all(fin.finish_reason in ("stop", "length") for _, fin in results.values())
    assert model.live_samplers == 0


def test_empty_prompt_is_refused(make_engine):
    engine = make_engine(FakeModel())
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], greedy(2))


# -- admission, budget and modes through the engine ----------------------------------------------


def test_serial_mode_serves_priority_then_arrival_one_at_a_time(make_engine):
    model = FakeModel(n_seq_max=4)
    engine = make_engine(model, mode="serial")
    order: list[int] = []
    engine.finished_listeners.append(lambda stats: order.append(stats.request_id))
    reqs = [engine.submit(prompt(i + 1), greedy(3, ignore_eos=True), priority=p) for i, p in enumerate((2, 0, 1, 0))]
    run_all(engine, reqs)
    assert order == [reqs[1].request_id, reqs[3].request_id, reqs[2].request_id, reqs[0].request_id]
    assert all(len(b) == 1 for b in model.batches)
    assert max(it.num_running for it in engine.iterations) == 1
    assert len(model.batches) == 4 * 3


def test_batches_follow_the_budget_decode_first_then_prompt_chunks(make_engine):
    model = FakeModel(n_ctx=256, n_batch=16, n_seq_max=4)
    engine = make_engine(model, token_budget=8)
    a = engine.submit(prompt(1, 2), greedy(4, ignore_eos=True))
    b = engine.submit(prompt(2, 12), greedy(3, ignore_eos=True))
    c = engine.submit(prompt(3, 12), greedy(2, ignore_eos=True))
    run_all(engine, [a, b, c])
    names = {a.request_id: "A", b.request_id: "B", c.request_id: "C"}
    assert layout(model, names) == [
        [("A", 0, 2, True), ("B", 0, 6, False)],
        [("A", 2, 1, True), ("B", 6, 6, True), ("C", 0, 1, False)],
        [("A", 3, 1, True), ("B", 12, 1, True), ("C", 1, 6, False)],
        [("A", 4, 1, True), ("B", 13, 1, True), ("C", 7, 5, True)],
        [("C", 12, 1, True)],
    ]
    assert [e.slot for e in model.batches[1]] == [0, 1, 2]
    assert [(it.num_decode_tokens, it.num_prompt_tokens) for it in engine.iterations] == [
        (0, 8), (1, 7), (2, 6), (2, 5), (1, 0)
    ]
    assert all(sum(len(e.tokens) for e in batch) <= 8 for batch in model.batches)
    assert model.violations == []
    for r in (a, b, c):
        assert r.output_tokens == model.expected_tokens(r.prompt_tokens, r.params.max_tokens)


def test_budget_defaults_to_n_batch_and_splits_a_long_prompt(make_engine):
    model = FakeModel(n_ctx=512, n_batch=32, n_seq_max=2)
    engine = make_engine(model)
    r = engine.submit(prompt(1, 100), greedy(2, ignore_eos=True))
    run_all(engine, [r])
    assert [[(e.start_pos, len(e.tokens), e.want_logits) for e in b] for b in model.batches] == [
        [(0, 32, False)], [(32, 32, False)], [(64, 32, False)], [(96, 4, True)], [(100, 1, True)]
    ]
    assert engine.scheduler.config.token_budget == 32


def test_continuous_mode_lets_a_newcomer_join_mid_generation(make_engine):
    model = FakeModel(n_seq_max=4)
    engine = make_engine(model, mode="continuous")
    joined: list[Request] = []

    def on_decode(call: int, _chunks) -> None:
        if call == 3:
            joined.append(engine.submit(prompt(9, 5), greedy(2, ignore_eos=True)))

    model.on_decode = on_decode
    a = engine.submit(prompt(1), greedy(6, ignore_eos=True))
    engine.start()
    collect(a)
    (c,) = joined
    collect(c)
    names = {a.request_id: "A", c.request_id: "C"}
    assert layout(model, names) == [
        [("A", 0, 4, True)],
        [("A", 4, 1, True)],
        [("A", 5, 1, True)],
        [("A", 6, 1, True), ("C", 0, 5, True)],
        [("A", 7, 1, True), ("C", 5, 1, True)],
        [("A", 8, 1, True)],
    ]
    assert a.output_tokens == model.expected_tokens(a.prompt_tokens, 6)
    assert c.output_tokens == model.expected_tokens(c.prompt_tokens, 2)


def test_continuous_mode_refills_a_freed_slot_at_once(make_engine):
    model = FakeModel(n_seq_max=2)
    engine = make_engine(model)
    short = engine.submit(prompt(1), greedy(2, ignore_eos=True))
    long = engine.submit(prompt(2), greedy(6, ignore_eos=True))
    nxt = engine.submit(prompt(3), greedy(2, ignore_eos=True))
    run_all(engine, [short, long, nxt])
    assert model.batches_of(short.request_id) == [0, 1]
    assert model.batches_of(nxt.request_id) == [2, 3]
    assert model.batches_of(long.request_id) == [0, 1, 2, 3, 4, 5]
    assert [e.slot for e in model.batches[2] if e.request_id == nxt.request_id] == [0]


def test_static_mode_makes_the_next_batch_wait_for_the_longest_answer(make_engine):
    model = FakeModel(n_seq_max=2)
    engine = make_engine(model, mode="static")
    finished_at: dict[int, int] = {}
    engine.finished_listeners.append(lambda s: finished_at.setdefault(s.request_id, len(model.batches)))
    short = engine.submit(prompt(1), greedy(2, ignore_eos=True))
    long = engine.submit(prompt(2), greedy(6, ignore_eos=True))
    nxt = engine.submit(prompt(3), greedy(2, ignore_eos=True))
    run_all(engine, [short, long, nxt])
    assert model.batches_of(short.request_id) == [0, 1]
    assert model.batches_of(long.request_id) == [0, 1, 2, 3, 4, 5]
    assert model.batches_of(nxt.request_id) == [6, 7]
    assert [len(b) for b in model.batches] == [2, 2, 1, 1, 1, 1, 1, 1]
    # The short answer is computed by batch 2 but answered with its batch, when the longest ends.
    assert finished_at == {short.request_id: 6, long.request_id: 6, nxt.request_id: 8}
    assert short.finished_s == long.finished_s
    # Its KV was freed when it ended (before batch 2), not held until the batch ended.
    assert [len(b) for b in model.batches[2:6]] == [1, 1, 1, 1] and model.cleared[0] == 0
    # The next request queued behind a free slot until the longest answer ended.
    assert [it.num_waiting for it in engine.iterations] == [1, 1, 1, 1, 1, 1, 0, 0]


def test_admission_does_not_overcommit_the_cache_with_prompts(make_engine):
    # Two 30-token prompts plus the decode reserve don't fit 64 cells together: the second
    # must wait rather than be admitted and preempted straight away.
    model = FakeModel(n_ctx=64, n_batch=64, n_seq_max=4)
    engine = make_engine(model)
    reqs = [engine.submit(prompt(i + 1, 30), greedy(2, ignore_eos=True)) for i in range(3)]
    run_all(engine, reqs)
    assert engine.counters.preemptions_total == 0
    assert model.rejected == []
    assert [len(b) for b in model.batches] == [1, 1, 1, 1, 1, 1]
    for r in reqs:
        assert r.output_tokens == model.expected_tokens(r.prompt_tokens, 2)


# -- preemption ---------------------------------------------------------------------------------


def _pressure_run(make_engine, n_ctx: int, max_tokens: int = 24):
    model = FakeModel(n_ctx=n_ctx, n_batch=32, n_seq_max=8)
    engine = make_engine(model, token_budget=32)
    preemptions: list[tuple[Request, list[Request]]] = []
    original_preempt = engine.scheduler.preempt

    def spy(victim: Request, reason: str = "kv") -> int:
        preemptions.append((victim, list(engine.scheduler.running)))
        return original_preempt(victim, reason)

    engine.scheduler.preempt = spy
    reqs = [
        engine.submit(prompt(50 + i, 6), greedy(max_tokens, ignore_eos=True), priority=i % 2, arrival_s=float(i))
        for i in range(8)
    ]
    results = run_all(engine, reqs)
    return model, engine, reqs, results, preemptions


def test_preemption_under_a_tiny_cache_completes_every_request_identically(make_engine):
    model, engine, reqs, results, preemptions = _pressure_run(make_engine, n_ctx=64)
    ref_model, _, ref_reqs, ref_results, ref_preemptions = _pressure_run(make_engine, n_ctx=4096)
    assert ref_preemptions == [] and engine.counters.preemptions_total > 0
    assert len(preemptions) == engine.counters.preemptions_total == engine.scheduler.num_preemptions_total
    assert sum(r.num_preemptions for r in reqs) == len(preemptions)
    assert sum(it.num_preemptions for it in engine.iterations) == len(preemptions)
    assert model.rejected, "the fake must have refused some batches"
    for r, ref in zip(reqs, ref_reqs):
        deltas, fin = results[r.request_id]
        ref_deltas, _ = ref_results[ref.request_id]
        assert fin.finish_reason == "length"
        assert len(r.output_tokens) == 24 and sum(d.num_tokens for d in deltas) == 24
        assert r.output_tokens == ref.output_tokens == model.expected_tokens(r.prompt_tokens, 24)
        assert text_of(deltas) == text_of(ref_deltas)
        assert fin.stats.num_preemptions == r.num_preemptions
    # No request lost or duplicated: one Finished each (collect checked nothing follows it).
    assert engine.counters.requests_finished == {"length": 8}
    assert model.violations == []
    assert only_cache_left(engine, model) and model.live_samplers == 0
    assert all(it.kv_used <= it.kv_total == 64 for it in engine.iterations)


def test_preemption_victim_is_lowest_priority_then_most_recent(make_engine):
    _, engine, reqs, _, preemptions = _pressure_run(make_engine, n_ctx=64)
    assert preemptions
    for victim, running in preemptions:
        assert victim in running and len(running) > 1
        for other in running:
            if other is not victim:
                assert (other.priority, other.arrival_s) < (victim.priority, victim.arrival_s)
    # The most urgent class only gives way when no less urgent sequence runs.
    for victim, running in preemptions:
        if victim.priority == 0:
            assert all(r.priority == 0 for r in running)


def test_a_sequence_that_cannot_fit_even_alone_fails_and_the_engine_goes_on(make_engine):
    model = FakeModel(n_ctx=64, kv_capacity=20)
    engine = make_engine(model).start()
    big = engine.submit(prompt(1, 10), greedy(30, ignore_eos=True))
    deltas, fin = collect(big)
    assert fin.finish_reason == "error"
    assert "cannot hold" in fin.error
    # Cells 10..20 held the prompt and ten generated tokens; the eleventh never fit.
    assert fin.stats.num_completion_tokens == len(deltas) == 11
    assert only_cache_left(engine, model)
    small = engine.submit(prompt(2, 4), greedy(3, ignore_eos=True))
    _, fin_small = collect(small)
    assert fin_small.finish_reason == "length"
    assert small.output_tokens == model.expected_tokens(small.prompt_tokens, 3)
    assert model.violations == [] and only_cache_left(engine, model) and model.live_samplers == 0


# -- cancellation -------------------------------------------------------------------------------


def test_cancelling_a_waiting_request(make_engine):
    model = FakeModel(n_seq_max=1)
    engine = make_engine(model)
    a = engine.submit(prompt(1), greedy(3, ignore_eos=True))
    b = engine.submit(prompt(2), greedy(3, ignore_eos=True))
    engine.cancel(b)
    results = run_all(engine, [a, b])
    deltas, fin = results[b.request_id]
    assert deltas == [] and fin.finish_reason == "cancelled"
    assert b.status is RequestStatus.FINISHED_CANCELLED
    assert model.batches_of(b.request_id) == []
    assert fin.stats.ttft_ms is None and fin.stats.num_completion_tokens == 0
    assert results[a.request_id][1].finish_reason == "length"
    assert model.live_samplers == 0
    assert engine.counters.requests_finished == {"length": 1, "cancelled": 1}


def test_cancelling_a_running_request_frees_its_slot_within_one_iteration(make_engine):
    model = FakeModel(n_seq_max=2)
    engine = make_engine(model)
    seen: dict[int, tuple] = {}

    def on_decode(call: int, _chunks) -> None:
        if call == 3:
            engine.cancel(a)
        if call == 4:
            seen[call] = (a.slot, list(model.cells[0]), a.status, engine.scheduler.running[:])

    model.on_decode = on_decode
    a = engine.submit(prompt(1), greedy(8, ignore_eos=True))
    b = engine.submit(prompt(2), greedy(8, ignore_eos=True))
    c = engine.submit(prompt(3), greedy(2, ignore_eos=True))
    results = run_all(engine, [a, b, c])
    slot, cells, status, running = seen[4]
    assert slot is None and status is RequestStatus.FINISHED_CANCELLED
    assert cells == []  # slot 0's cells were freed before the next decode ...
    assert running == [b, c] and model.batches_of(c.request_id)[0] == 3  # ... and reused
    assert [e.slot for e in model.batches[3] if e.request_id == c.request_id] == [0]
    deltas, fin = results[a.request_id]
    assert fin.finish_reason == "cancelled"
    assert len(a.output_tokens) == 3 and len(deltas) == 3 and fin.stats.num_completion_tokens == 3
    assert model.batches_of(a.request_id) == [0, 1, 2]
    assert b.output_tokens == model.expected_tokens(b.prompt_tokens, 8)
    assert c.output_tokens == model.expected_tokens(c.prompt_tokens, 2)
    assert 0 in model.cleared
    assert model.violations == [] and model.live_samplers == 0 and only_cache_left(engine, model)


def test_cancelling_a_finished_request_is_harmless(make_engine):
    model = FakeModel()
    engine = make_engine(model)
    r = engine.submit(prompt(1), greedy(2, ignore_eos=True))
    run_all(engine, [r])
    engine.cancel(r)
    other = engine.submit(prompt(2), greedy(2, ignore_eos=True))
    _, fin = collect(other)
    assert fin.finish_reason == "length"
    assert r.events.empty()
    assert engine.counters.requests_finished == {"length": 2}


def test_stop_cancels_what_is_still_in_the_engine(make_engine):
    model = FakeModel(n_seq_max=1, decode_delay_s=0.005)
    engine = make_engine(model)
    running = engine.submit(prompt(1), greedy(10_000, ignore_eos=True))
    waiting = engine.submit(prompt(2), greedy(5, ignore_eos=True))
    engine.start()
    assert isinstance(running.events.get(timeout=TIMEOUT_S), Delta)
    engine.stop()
    for r in (running, waiting):
        _, fin = collect(r)
        assert fin.finish_reason == "cancelled"
        assert "shutting down" in fin.error
    assert only_cache_left(engine, model) and model.live_samplers == 0


def test_an_exception_in_decode_fails_running_requests_only(make_engine, caplog):
    model = FakeModel(n_seq_max=1)
    engine = make_engine(model)

    def on_decode(call: int, _chunks) -> None:
        if call == 2:
            raise RuntimeError("boom")

    model.on_decode = on_decode
    a = engine.submit(prompt(1), greedy(4, ignore_eos=True))
    b = engine.submit(prompt(2), greedy(4, ignore_eos=True))
    with caplog.at_level(logging.ERROR, logger="app.engine.engine"):
        results = run_all(engine, [a, b])
    assert results[a.request_id][1].finish_reason == "error"
    assert "boom" in results[a.request_id][1].error
    assert results[b.request_id][1].finish_reason == "length"
    assert b.output_tokens == model.expected_tokens(b.prompt_tokens, 4)
    assert "engine iteration failed" in caplog.text
    assert only_cache_left(engine, model) and model.live_samplers == 0 and model.violations == []


# -- stats --------------------------------------------------------------------------------------


def test_request_stats_on_a_fake_clock(make_engine):
    model = FakeModel(n_seq_max=4, decode_step_s=0.010)
    engine = make_engine(model, mode="serial")
    t_submit = model.clock()
    a = engine.submit(prompt(1, 5), greedy(3, ignore_eos=True))
    b = engine.submit(prompt(2, 7), greedy(2, ignore_eos=True), class_name="interactive", priority=1)
    results = run_all(engine, [a, b])
    sa, sb = results[a.request_id][1].stats, results[b.request_id][1].stats
    assert model.clock() == pytest.approx(t_submit + 0.050)
    # a: admitted at once, first token after one decode, then one token per decode.
    assert sa.queue_ms == pytest.approx(0.0)
    assert sa.ttft_ms == pytest.approx(10.0)
    assert sa.tpot_ms == pytest.approx(10.0)
    assert sa.total_ms == pytest.approx(30.0)
    # b waited for all three decodes of a.
    assert sb.queue_ms == pytest.approx(30.0)
    assert sb.ttft_ms == pytest.approx(40.0)
    assert sb.tpot_ms == pytest.approx(10.0)
    assert sb.total_ms == pytest.approx(50.0)
    assert (sa.num_prompt_tokens, sa.num_completion_tokens, sa.num_preemptions) == (5, 3, 0)
    assert (sb.num_prompt_tokens, sb.num_completion_tokens) == (7, 2)
    assert (sb.class_name, sb.priority, sb.finish_reason) == ("interactive", 1, "length")
    assert sb.as_dict()["request_id"] == b.request_id


def test_tpot_of_an_eos_ended_request_is_the_time_between_output_tokens(make_engine):
    model = FakeModel(scripts={tuple(prompt(1)): [40, 41, 42]}, decode_step_s=0.010)
    engine = make_engine(model)
    r = engine.submit(prompt(1), greedy(10))
    _, fin = run_all(engine, [r])[r.request_id]
    assert fin.finish_reason == "stop" and fin.stats.num_completion_tokens == 3
    assert fin.stats.ttft_ms == pytest.approx(10.0)
    assert fin.stats.total_ms == pytest.approx(40.0)  # the EOS decode is part of the request's time ...
    assert fin.stats.tpot_ms == pytest.approx(10.0)  # ... but not of the time between output tokens


def test_events_iterator_polls_then_ends_with_finished(make_engine):
    model = FakeModel(decode_delay_s=0.02)
    engine = make_engine(model)
    r = engine.submit(prompt(1), greedy(3, ignore_eos=True))
    events = engine.events(r, poll_s=0.005)
    assert next(events) is None  # nothing yet: the engine has not started
    engine.start()
    got = [ev for ev in events if ev is not None]
    assert [type(ev) for ev in got] == [Delta, Delta, Delta, Finished]
    assert got[-1].finish_reason == "length"


def test_iteration_stats_and_counters(make_engine):
    model = FakeModel(n_ctx=128, n_batch=16, n_seq_max=2)
    engine = make_engine(model, token_budget=8)
    snaps = []
    model.on_decode = lambda call, chunks: snaps.append(engine.snapshot())
    a = engine.submit(prompt(1, 10), greedy(3, ignore_eos=True))
    b = engine.submit(prompt(2, 4), greedy(2, ignore_eos=True))
    c = engine.submit(prompt(3, 3), greedy(2, ignore_eos=True))
    run_all(engine, [a, b, c])
    its = list(engine.iterations)
    # 1: a 8 | 2: a 2 (sample), b 4 (sample) | 3: a, b decode -> b done | 4: a decode -> a done, c 3 | 5: c decode
    assert [(it.num_seqs, it.num_decode_tokens, it.num_prompt_tokens) for it in its] == [
        (1, 0, 8), (2, 0, 6), (2, 2, 0), (2, 1, 3), (1, 1, 0)
    ]
    assert [(it.num_running, it.num_waiting) for it in its] == [(2, 1), (2, 1), (1, 1), (1, 0), (0, 0)]
    assert [it.kv_used for it in its] == [8, 14, 11, 3, 0]
    assert all(it.kv_total == 128 for it in its)
    assert all(it.iteration_ms == pytest.approx(10.0) for it in its)
    assert all(it.decode_ms >= 0 and it.outside_decode_ms >= 0 for it in its)
    assert [s.kv_used for s in snaps] == [0, 8, 14, 11, 3]
    assert snaps[1].slots[0]["prefilling"] and snaps[1].slots[0]["n_ctx_used"] == 8
    assert snaps[2].slots[1]["request_id"] == b.request_id
    cnt = engine.counters
    assert cnt.iterations_total == 5 and cnt.decode_calls_total == 5
    assert cnt.prompt_tokens_total == 17
    assert cnt.tokens_predicted_total == 7
    assert cnt.busy_slots_total == 8
    assert cnt.requests_total == 3 and cnt.requests_finished == {"length": 3}
    assert cnt.prompt_seconds_total + cnt.tokens_predicted_seconds_total == pytest.approx(0.050)
    last = engine.snapshot()
    assert last.last_iteration == its[-1] and last.num_running == 0 and last.kv_used == 0


def test_requests_submitted_from_many_threads_all_finish(make_engine):
    model = FakeModel(n_ctx=512, n_batch=32, n_seq_max=4, decode_delay_s=0.001)
    engine = make_engine(model).start()
    reqs: list[Request] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        r = engine.submit(prompt(100 + i, 3 + i % 5), greedy(1 + i % 7, ignore_eos=True), priority=i % 3)
        with lock:
            reqs.append(r)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in reqs:
        deltas, fin = collect(r)
        assert fin.finish_reason == "length"
        assert r.output_tokens == model.expected_tokens(r.prompt_tokens, r.params.max_tokens)
    assert len({r.request_id for r in reqs}) == 24
    assert model.violations == [] and only_cache_left(engine, model) and model.live_samplers == 0



def test_logprobs_ride_on_each_token_delta_only_when_asked():
    from app.engine.request import Delta, SamplingParams

    model = FakeModel()
    engine = Engine(model).start()
    try:
        for logprobs, expect in ((2, True), (None, False)):
            r = engine.submit([5, 6, 7], SamplingParams(max_tokens=3, temperature=0, logprobs=logprobs))
            deltas = [ev for ev in engine.events(r) if isinstance(ev, Delta)]
            assert len(deltas) == 3
            assert all((d.logprob is not None) == expect for d in deltas)
            if expect:
                assert len(deltas[0].logprob["top_logprobs"]) == 2
            assert r.status.finished
    finally:
        engine.stop()


# -- preemption by priority -----------------------------------------------------------------------


def test_a_voice_request_takes_the_only_slot_and_background_resumes_from_its_cached_cells(make_engine):
    background_slo = SloTargets(ttft_ms=30000, tpot_ms=500, preemptible=True)
    voice_slo = SloTargets(ttft_ms=500, tpot_ms=100)
    submitted: list[Request] = []

    def voice_arrives(n: int, chunks) -> None:
        if n == 6:  # the background answer is under way
            submitted.append(engine.submit(prompt(2, 5), greedy(3, ignore_eos=True), priority=0,
                                           class_name="voice", slo=voice_slo))

    model = FakeModel(n_seq_max=1, on_decode=voice_arrives)
    engine = make_engine(model)
    bg = engine.submit(prompt(1, 40), greedy(12, ignore_eos=True), priority=3, class_name="background",
                       cache_prompt=False, slo=background_slo)
    bg_deltas, bg_fin = run_all(engine, [bg])[bg.request_id]
    (voice,) = submitted
    _, voice_fin = collect(voice)
    assert voice_fin.finish_reason == "length" and voice.finished_s < bg.finished_s
    assert (bg_fin.finish_reason, bg_fin.stats.num_preemptions) == ("length", 1)
    assert bg.output_tokens == model.expected_tokens(bg.prompt_tokens, 12)  # as if never interrupted
    assert engine.counters.preemptions_total == 1
    assert engine.snapshot().preemptions_by_class == {("background", "slot"): 1}
    # On resumption only its last token went through the model again: its cells had stayed cached.
    resumed = next(b for b in model.batches[6:] if b[0].request_id == bg.request_id)
    assert len(resumed[0].tokens) == 1 and model.violations == []


def test_the_full_batch_pace_is_the_measured_period_of_full_decode_only_iterations(make_engine):
    """The pace the Overview shows ("a token every X ms with N at once") is what the sequences of a full batch waited
    between tokens (the fake clock: 10 ms a decode), not the cost fit's extrapolation; half-full iterations and the idle
    wait after the last full one are left out."""
    model = FakeModel(n_seq_max=2, decode_step_s=0.010)
    engine = make_engine(model)
    a = engine.submit(prompt(1), greedy(60, ignore_eos=True))
    b = engine.submit(prompt(2), greedy(60, ignore_eos=True))
    run_all(engine, [a, b])
    sched = engine.scheduler
    assert len(sched.full_batch_periods) >= 16
    assert sched.full_batch_decode_ms() == pytest.approx(10.0)
    assert sched.feasibility()["full_batch_decode_ms"] == pytest.approx(10.0)
    # One sequence alone afterwards is no full batch: the measured pace stays.
    c = engine.submit(prompt(3), greedy(30, ignore_eos=True))
    collect(c)
    assert sched.full_batch_decode_ms() == pytest.approx(10.0)


def test_snapshot_carries_a_copy_of_the_counters_that_later_work_does_not_change(make_engine):
    model = FakeModel()
    engine = make_engine(model)
    first = engine.submit(prompt(1), greedy(4, ignore_eos=True))
    run_all(engine, [first])
    before = engine.snapshot()
    assert before.counters.requests_finished == {"length": 1}
    assert before.counters.tokens_predicted_total == engine.counters.tokens_predicted_total == 4
    assert before.prefix_cache_counters.query_tokens_total == engine.scheduler.cache.counters.query_tokens_total
    assert before.prefix_cache_max_entries == engine.scheduler.cache.max_entries
    second = engine.submit(prompt(2), greedy(4, ignore_eos=True))
    run_all(engine, [second])
    assert engine.counters.requests_finished == {"length": 2} and engine.counters.tokens_predicted_total == 8
    assert before.counters.requests_finished == {"length": 1} and before.counters.tokens_predicted_total == 4
    assert engine.snapshot().counters.requests_finished == {"length": 2}


class CountingModel(FakeModel):
    """Counts the tokens sampled, so a test can see when an event left the engine."""

    num_samples = 0

    def sample(self, sampler, params, batch_index):
        self.num_samples += 1
        return super().sample(sampler, params, batch_index)


def test_an_iterations_events_reach_their_readers_once_every_sequence_is_sampled(make_engine):
    model = CountingModel()
    engine = make_engine(model)
    requests = [engine.submit(prompt(tag), greedy(3, ignore_eos=True)) for tag in (1, 4, 5)]
    delivered: list[tuple[int, object]] = []  # (tokens sampled so far, event) at each hand-over

    class Recorded(queue.SimpleQueue):
        def put(self, ev, *args, **kwargs):
            delivered.append((model.num_samples, ev))
            super().put(ev, *args, **kwargs)

    for r in requests:
        r.events = Recorded()
    results = run_all(engine, requests)
    assert all(len(deltas) == 3 for deltas, _ in results.values())
    # The three sequences run side by side from the first iteration: no event goes out mid-iteration, so a
    # stream's thread never wakes to take the GIL while the engine still samples the others.
    assert [n for n, _ in delivered] == [3] * 3 + [6] * 3 + [9] * 6
    assert model.violations == []
