"""Tests for app.engine.prefix_cache and its use by the scheduler and engine, on the fake model's physical cells."""

import random

import pytest
from fake_model import FakeModel

from app.engine.engine import Engine
from app.engine.prefix_cache import PrefixCache
from app.engine.request import Delta, Finished, Request, RequestStatus, SamplingParams

TIMEOUT_S = 10.0


def tokens(tag: int, n: int) -> list[int]:
    """n tokens that start with tag and continue with numbers of their own."""
    return [tag] + [1000 * tag + i for i in range(n - 1)]


def fill(model: FakeModel, cache: PrefixCache, slot: int, toks: list[int]) -> None:
    """Compute toks for a slot the way the engine does: decode, then tell the cache."""
    req = Request(prompt_tokens=toks)
    req.slot = slot
    start = cache.length(slot)
    from app.engine.scheduler import Chunk

    rc, _ = model.decode([Chunk(req, toks, start, True)])
    assert rc == 0
    cache.extend(slot, toks)


def consistent(model: FakeModel, cache: PrefixCache) -> None:
    """The tree's invariants hold and its cell count is the model's."""
    assert cache.check() == []
    assert model.violations == []
    assert cache.cells_total == model.kv_used


@pytest.fixture
def model():
    return FakeModel(n_ctx=512, n_batch=512, n_seq_max=4)


# -- the tree ------------------------------------------------------------------------------------


def test_a_finished_prefix_is_shared_by_copy_and_counted_once(model):
    cache = PrefixCache(model, num_slots=4)
    system = tokens(1, 40)
    cache.attach(0, cache.match(system))
    fill(model, cache, 0, system + [7, 8])
    cache.release(0, keep=True)
    consistent(model, cache)
    assert cache.cells_running == 0 and cache.cells_cached == 42

    m = cache.match(system + [9, 9])
    assert (m.num_tokens, m.num_running) == (40, 0)
    assert cache.attach(1, m) == 40
    assert model.tokens_of(1) == system
    fill(model, cache, 1, [9, 9])
    consistent(model, cache)
    # 42 cells of the entry, 2 new ones: the 40 shared cells exist once.
    assert model.kv_used == 44 and cache.cells_running == 42 and cache.cells_cached == 2


def test_a_running_sequence_shares_its_computed_prefix(model):
    cache = PrefixCache(model, num_slots=4)
    cache.attach(0, cache.match([]))
    fill(model, cache, 0, tokens(1, 30))
    m = cache.match(tokens(1, 20) + [5])
    assert (m.num_tokens, m.num_running) == (20, 20)
    cache.attach(1, m)
    fill(model, cache, 1, [5])
    fill(model, cache, 0, [6])  # the first sequence goes on growing its own branch
    consistent(model, cache)
    assert model.tokens_of(0) == tokens(1, 30) + [6]
    assert model.tokens_of(1) == tokens(1, 20) + [5]
    assert model.kv_used == 32


def test_an_entry_covered_by_a_longer_one_is_dropped(model):
    cache = PrefixCache(model, num_slots=4)
    turn1 = tokens(1, 20)
    cache.attach(0, cache.match(turn1))
    fill(model, cache, 0, turn1)
    cache.release(0, keep=True)
    turn2 = turn1 + [3, 4, 5]
    cache.attach(0, cache.match(turn2[:-1]))
    fill(model, cache, 0, turn2[20:])
    cache.release(0, keep=True)
    consistent(model, cache)
    assert len(cache.entries) == 1 and model.kv_used == 23


def test_two_satellites_keep_their_histories_and_share_the_system_prompt(model):
    cache = PrefixCache(model, num_slots=4)
    system = tokens(1, 100)
    for slot, area in ((0, 50), (1, 60)):
        cache.attach(slot, cache.match(system + [area]))
        fill(model, cache, slot, (system + [area, area + 1])[cache.length(slot):])
        cache.release(slot, keep=True)
    consistent(model, cache)
    assert len(cache.entries) == 2 and model.kv_used == 104
    assert cache.match(system + [50, 51, 9]).num_tokens == 102
    assert cache.match(system + [60, 61, 9]).num_tokens == 102


def test_eviction_frees_the_least_recently_used_leaf_first(model):
    cache = PrefixCache(model, num_slots=4, clock=iter(range(100)).__next__)
    system = tokens(1, 20)
    for slot, tail in ((0, [50] * 5), (1, [60] * 7)):
        cache.attach(slot, cache.match(system + tail))
        fill(model, cache, slot, (system + tail)[cache.length(slot):])
        cache.release(slot, keep=True)
    cache.match(system)  # a lookup alone is no use
    cache.attach(2, cache.match(system + [50] * 5))  # the first entry is used again
    cache.release(2, keep=True)
    freed = cache.evict(1)
    consistent(model, cache)
    assert freed == 7 and model.kv_used == 25  # the second branch went, the shared prompt stayed
    assert cache.evict(100) == 25 and model.kv_used == 0 and not cache.entries


def test_eviction_never_frees_cells_a_running_sequence_holds(model):
    cache = PrefixCache(model, num_slots=4)
    cache.attach(0, cache.match([]))
    fill(model, cache, 0, tokens(1, 20))
    cache.release(0, keep=True)
    cache.attach(1, cache.match(tokens(1, 20)))
    assert cache.evict(100) == 0
    consistent(model, cache)
    assert model.tokens_of(1) == tokens(1, 20)


def test_a_released_slot_that_is_not_kept_frees_only_its_own_cells(model):
    cache = PrefixCache(model, num_slots=4)
    cache.attach(0, cache.match([]))
    fill(model, cache, 0, tokens(1, 20))
    cache.attach(1, cache.match(tokens(1, 16)))
    fill(model, cache, 1, [4, 4, 4])
    cache.release(0, keep=False)
    consistent(model, cache)
    assert model.kv_used == 19 and model.tokens_of(1) == tokens(1, 16) + [4, 4, 4]


def test_entries_are_bounded_by_sequence_ids(model):
    cache = PrefixCache(model, num_slots=4, max_seq_ids=8)
    assert cache.max_entries == 4
    for i in range(6):
        cache.attach(0, cache.match([]))
        fill(model, cache, 0, tokens(i + 1, 5))
        cache.release(0, keep=True)
    consistent(model, cache)
    assert len(cache.entries) == 4 and model.kv_used == 20


def test_the_guard_holds_every_cell_under_two_sequence_ids():
    model = FakeModel(n_ctx=512, n_batch=512, n_seq_max=4, n_swa=8)
    cache = PrefixCache(model, num_slots=4, guard=True)
    cache.attach(0, cache.match([]))
    fill(model, cache, 0, tokens(1, 20))
    cache.attach(1, cache.match(tokens(1, 12)))
    fill(model, cache, 1, [5, 5])
    cache.release(0, keep=True)
    consistent(model, cache)
    # Two holders at least for every cell: llama.cpp only overwrites cells held by one sequence.
    assert min(model.refs.values()) >= 2
    cache.release(1, keep=False)
    cache.evict(100)
    assert model.kv_used == 0


def test_short_matches_are_not_worth_sharing(model):
    cache = PrefixCache(model, num_slots=4)
    cache.attach(0, cache.match([]))
    fill(model, cache, 0, tokens(1, 40))
    assert cache.match(tokens(1, 15) + [3]).num_tokens == 0
    assert cache.match(tokens(1, 16) + [3]).num_tokens == 16


def test_a_disabled_cache_matches_nothing_and_keeps_nothing(model):
    cache = PrefixCache(model, num_slots=4, enabled=False)
    cache.attach(0, cache.match([]))
    fill(model, cache, 0, tokens(1, 20))
    assert cache.match(tokens(1, 20)).num_tokens == 0
    cache.release(0, keep=True)
    consistent(model, cache)
    assert model.kv_used == 0


# -- the engine ----------------------------------------------------------------------------------


@pytest.fixture
def make_engine():
    engines: list[Engine] = []

    def factory(model: FakeModel, **kwargs) -> Engine:
        engine = Engine(model, clock=model.clock, **kwargs)
        engines.append(engine)
        return engine.start()

    yield factory
    for engine in engines:
        engine.stop()


def run(engine: Engine, prompt: list[int], max_tokens: int = 4, **kwargs) -> tuple[Request, str, Finished]:
    """Submit and wait for the end; returns the request, its text and its Finished event."""
    r = engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs.pop("params", {})),
                      **kwargs)
    return (r, *collect(r))


def collect(r: Request) -> tuple[str, Finished]:
    """The request's text and its last event."""
    text = ""
    while True:
        ev = r.events.get(timeout=TIMEOUT_S)
        if isinstance(ev, Finished):
            return text, ev
        assert isinstance(ev, Delta)
        text += ev.text


def prompt_batches(model: FakeModel, request_id: int) -> int:
    """Prompt tokens of one request that went through the model."""
    n = 0
    for b in model.batches:
        for e in b:
            if e.request_id == request_id and len(e.tokens) > 1:
                n += len(e.tokens)
    return n


def test_a_repeated_prompt_prefills_only_its_last_token_and_answers_the_same(make_engine):
    model = FakeModel(n_ctx=512, n_batch=64, n_seq_max=4)
    engine = make_engine(model)
    prompt = tokens(1, 100)
    first, text1, fin1 = run(engine, prompt, max_tokens=6, params={"ignore_eos": True})
    second, text2, fin2 = run(engine, prompt, max_tokens=6, params={"ignore_eos": True})
    assert text1 == text2 and second.output_tokens == model.expected_tokens(prompt, 6)
    assert fin1.stats.num_cached_tokens == 0 and fin2.stats.num_cached_tokens == 99
    # The last prompt token is computed again: its logits give the first sample.
    assert [len(e.tokens) for b in model.batches for e in b if e.request_id == second.request_id][0] == 1
    c = engine.scheduler.cache.counters
    assert (c.query_tokens_total, c.hit_tokens_total) == (200, 99)
    assert model.violations == []


def test_a_second_turn_reuses_the_first_turns_prompt_and_answer(make_engine):
    model = FakeModel(n_ctx=512, n_batch=64, n_seq_max=4)
    engine = make_engine(model)
    turn1 = tokens(1, 80)
    r1, _, _ = run(engine, turn1, max_tokens=5, params={"ignore_eos": True})
    turn2 = turn1 + r1.output_tokens + [7, 7, 7]
    r2, _, fin = run(engine, turn2, max_tokens=5, params={"ignore_eos": True})
    # The last answer token was sampled, never decoded: it is computed with the new message.
    assert fin.stats.num_cached_tokens == 80 + 4
    assert r2.output_tokens == model.expected_tokens(turn2, 5)
    assert len(engine.scheduler.cache.entries) == 1  # the first turn's entry is covered by the second's


def test_a_request_shares_the_prefix_of_one_still_running(make_engine):
    model = FakeModel(n_ctx=512, n_batch=64, n_seq_max=4, decode_delay_s=0.002)
    engine = make_engine(model)
    system = tokens(1, 60)
    long = engine.submit(system + [5], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    deadline_hits = 0
    while long.num_computed < 61 and deadline_hits < 5000:
        ev = long.events.get(timeout=TIMEOUT_S)
        deadline_hits += 1
        assert not isinstance(ev, Finished)
    short, _, fin = run(engine, system + [6, 6], max_tokens=3, params={"ignore_eos": True})
    assert long.status is RequestStatus.RUNNING
    assert fin.stats.num_cached_tokens == 60
    assert short.output_tokens == model.expected_tokens(system + [6, 6], 3)
    engine.cancel(long)
    collect(long)
    assert model.violations == []


def test_cache_prompt_false_computes_everything_and_leaves_nothing(make_engine):
    model = FakeModel(n_ctx=512, n_batch=64, n_seq_max=4)
    engine = make_engine(model)
    prompt = tokens(1, 50)
    run(engine, prompt)
    r, _, fin = run(engine, prompt, cache_prompt=False)
    assert fin.stats.num_cached_tokens == 0 and prompt_batches(model, r.request_id) == 50
    assert len(engine.scheduler.cache.entries) == 1


def test_the_setting_off_means_no_reuse(make_engine):
    model = FakeModel(n_ctx=512, n_batch=64, n_seq_max=4)
    engine = make_engine(model, prefix_cache=False)
    prompt = tokens(1, 50)
    run(engine, prompt)
    r, _, fin = run(engine, prompt)
    assert fin.stats.num_cached_tokens == 0 and model.kv_used == 0
    assert engine.snapshot().prefix_cache is False and "setting" in engine.snapshot().prefix_cache_note


def test_a_model_that_cannot_share_says_why(make_engine):
    model = FakeModel(share_blocker="recurrent state cannot be split by position")
    engine = make_engine(model)
    snap = engine.snapshot()
    assert snap.prefix_cache is False and "recurrent" in snap.prefix_cache_note


def test_cached_prefixes_are_evicted_before_any_running_sequence_is_preempted(make_engine):
    model = FakeModel(n_ctx=128, n_batch=64, n_seq_max=4)
    engine = make_engine(model)
    for tag in (1, 2, 3):
        run(engine, tokens(tag, 30), max_tokens=2)
    assert engine.scheduler.kv_cached >= 90
    # Two sequences that together need almost every cell: the cache must make way.
    a = engine.submit(tokens(4, 50), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    b = engine.submit(tokens(5, 50), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    for r in (a, b):
        _, fin = collect(r)
        assert fin.finish_reason == "length" and fin.stats.num_preemptions == 0
    assert engine.counters.preemptions_total == 0 and model.rejected == []
    assert engine.scheduler.cache.counters.evictions_total >= 2
    assert model.violations == []


def test_stop_strings_and_cancellation_keep_working_with_shared_cells(make_engine):
    pieces = {t: b"x" for t in range(10, 100)}
    model = FakeModel(n_ctx=512, n_batch=64, n_seq_max=4, pieces=pieces, decode_delay_s=0.001)
    engine = make_engine(model)
    system = tokens(1, 40)
    r, text, fin = run(engine, system + [5], max_tokens=50, params={"stop": ("xxx",), "ignore_eos": True})
    assert text == "" and fin.finish_reason == "stop" and len(r.output_tokens) == 3
    slow = engine.submit(system + [6], SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
    slow.events.get(timeout=TIMEOUT_S)
    engine.cancel(slow)
    _, fin = collect(slow)
    assert fin.finish_reason == "cancelled" and fin.stats.num_cached_tokens == 40
    after, _, fin = run(engine, system + [6, 1], max_tokens=3, params={"ignore_eos": True})
    assert after.output_tokens == model.expected_tokens(system + [6, 1], 3)
    assert engine.scheduler.kv_used == 0 and model.kv_used == engine.scheduler.kv_cached
    assert model.violations == []


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_shared_prefix_traffic_under_a_small_cache_answers_as_if_alone(make_engine, seed):
    """Random conversations over three system prompts, a cache that forces eviction and preemption."""
    rng = random.Random(seed)
    model = FakeModel(n_ctx=192, n_batch=32, n_seq_max=4)
    engine = make_engine(model, token_budget=32)
    systems = [tokens(tag, rng.randrange(20, 60)) for tag in (1, 2, 3)]
    requests = []
    for _ in range(30):
        prompt = rng.choice(systems) + [rng.randrange(10, 99) for _ in range(rng.randrange(1, 30))]
        requests.append(engine.submit(prompt, SamplingParams(max_tokens=rng.randrange(1, 80), temperature=0.0,
                                                             ignore_eos=True), priority=rng.randrange(3)))
    for r in requests:
        _, fin = collect(r)
        assert fin.finish_reason == "length"
        assert r.output_tokens == model.expected_tokens(r.prompt_tokens, r.params.max_tokens)
    assert model.violations == [] and engine.scheduler.cache.check() == []
    assert engine.scheduler.kv_used == 0 and model.kv_used == engine.scheduler.kv_cached
    assert sum(r.num_cached_tokens for r in requests) > 0
    # The load did what it is here for: entries were evicted and, with the cache empty, sequences preempted.
    assert engine.scheduler.cache.counters.evictions_total > 0 and engine.counters.preemptions_total > 0


def test_the_reuse_note_names_recurrent_and_sliding_window_models():
    from app.engine.prefix_cache import reuse_note

    assert reuse_note("mamba2", None).startswith("no prefix reuse")
    assert "sliding window of 512" in reuse_note("gemma3", 512)
    assert reuse_note("llama", None) == "prefix reuse"


def test_requests_arriving_together_compute_their_shared_prefix_once():
    model = FakeModel(n_ctx=1024, n_batch=64, n_seq_max=8)
    engine = Engine(model, clock=model.clock, token_budget=64)
    prefix = tokens(1, 150)
    prompts = [prefix + [20 + i] * 6 for i in range(8)]
    reqs = [engine.submit(p, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)) for p in prompts]
    engine.start()
    try:
        for r in reqs:
            _, fin = collect(r)
            assert r.output_tokens == model.expected_tokens(r.prompt_tokens, 3)
    finally:
        engine.stop()
    assert engine.counters.prompt_tokens_total == 150 + 8 * 6  # the prefix once, then every suffix
    assert [r.num_cached_tokens for r in reqs] == [0] + [150] * 7
    assert model.violations == []
