"""Tests for app.engine.kv_tiers: the host-RAM tier under the prefix cache, driven through the engine on a fake model.

The fake model's next token is a function of the tokens its cells hold, so a restore that put back the
wrong cells (or cells at the wrong positions) changes the answer; its violations catch holes and misuse.
"""

import pytest
from fake_model import FakeModel
from test_engine_fake import collect, greedy

from app.engine.engine import Engine
from app.engine.kv_tiers import MIB, RamTier, SavedPrefix, cache_ram_bytes

TRANSFER = 4  # 2 × n_seq_max, as LlamaModel reserves it


@pytest.fixture
def make_engine():
    """Engines on fake models, started, and stopped after the test."""
    engines: list[Engine] = []

    def factory(model: FakeModel, **kwargs) -> Engine:
        engine = Engine(model, clock=model.clock, **kwargs).start()
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.stop()


def long_prompt(tag: int, n: int = 40) -> list[int]:
    """A prompt of n tokens whose every token depends on its tag (no shared prefix between tags)."""
    return [tag * 1000 + i for i in range(n)]


def run(engine: Engine, tokens: list[int], n: int = 4):
    """Submit, wait, and return (output tokens, cached prompt tokens)."""
    r = engine.submit(tokens, greedy(n, ignore_eos=True))
    _, fin = collect(r)
    assert fin.error is None
    return r.output_tokens, fin.stats.num_cached_tokens


def small_model(**kwargs) -> FakeModel:
    """64 cells: one 40-token prompt's entry leaves no room for a second, so the first is evicted."""
    return FakeModel(n_ctx=64, n_batch=64, n_seq_max=2, transfer_seq=TRANSFER, **kwargs)


def test_an_evicted_prefix_comes_back_from_ram_with_the_same_answer(make_engine):
    model = small_model()
    engine = make_engine(model, cache_ram_bytes=None)
    a, b = long_prompt(1), long_prompt(2)
    first, cached = run(engine, a)
    assert cached == 0
    run(engine, b)  # needs the cells of a's entry: it is evicted, and saved
    assert engine.tiers.counters.saves_total == 1 and len(engine.tiers.ram) == 1
    again, cached = run(engine, a + [7, 8, 9])
    # Everything a's entry shared with the new prompt came back (its 40 prompt tokens and the 3 outputs
    # computed before the 4th ended it); only what is new was computed.
    assert cached == 40
    assert engine.tiers.counters.hits_total == 1 and engine.tiers.counters.restored_tokens_total == 40
    assert model.num_state_loads == 1
    fresh = FakeModel(n_ctx=64, n_batch=64, n_seq_max=2)
    assert again == fresh.expected_tokens(a + [7, 8, 9], 4)
    assert first == fresh.expected_tokens(a, 4)
    # b was evicted by the restore in turn, and comes back too.
    _, cached_b = run(engine, b)
    assert cached_b == 39 and engine.tiers.counters.hits_total == 2
    assert model.violations == [] and engine.scheduler.cache.check() == []
    assert model.seqs.get(TRANSFER, []) == []  # the transfer sequence is left empty


def test_no_tier_when_off_or_when_the_model_cannot_save_states(make_engine):
    off = make_engine(small_model(), cache_ram_bytes=0)
    no_states = make_engine(FakeModel(n_ctx=64, n_batch=64, n_seq_max=2), cache_ram_bytes=None)
    no_cache = make_engine(small_model(), cache_ram_bytes=None, prefix_cache=False)
    assert off.tiers is None and no_states.tiers is None and no_cache.tiers is None
    a, b = long_prompt(1), long_prompt(2)
    run(off, a)
    run(off, b)
    _, cached = run(off, a)
    assert cached == 0  # evicted and gone: prefilled again


def test_a_refused_restore_is_prefilled_and_the_saved_prefix_dropped(make_engine, caplog):
    model = small_model()
    engine = make_engine(model, cache_ram_bytes=None)
    a, b = long_prompt(1), long_prompt(2)
    first, _ = run(engine, a)
    run(engine, b)
    model.refuse_states = True
    again, cached = run(engine, a)
    assert cached == 0 and again == first
    assert engine.tiers.counters.failures_total == 1 and engine.tiers.counters.hits_total == 0
    assert "refused a saved prefix" in caplog.text
    assert model.violations == [] and engine.scheduler.cache.check() == []
    assert model.seqs.get(TRANSFER, []) == [] and model.seqs.get(0, []) == []


def test_a_kv_hit_longer_than_the_tier_s_leaves_the_tier_alone(make_engine):
    model = small_model()
    engine = make_engine(model, cache_ram_bytes=None)
    a = long_prompt(1, 20)
    run(engine, a)
    _, cached = run(engine, a + [5])
    assert cached == 20 and engine.tiers.counters.hits_total == 0 and model.num_state_loads == 0


def saved(tokens: list[int], size: int) -> SavedPrefix:
    """A saved prefix of `size` bytes."""
    return SavedPrefix(tokens, len(tokens), [bytearray(size)], 0.0)


def test_the_ram_tier_drops_least_recently_used_and_never_holds_more_than_its_budget():
    tier = RamTier(max_bytes=100)
    x, y, z = saved([1] * 20, 40), saved([2] * 20, 40), saved([3] * 20, 40)
    assert tier.put(x) and tier.put(y)
    tier.touch(x)  # y is now the least recently used
    assert tier.put(z)
    assert tier.num_bytes == 80 <= 100 and x in tier and z in tier and y not in tier
    assert tier.num_dropped == 1
    assert not tier.put(saved([4] * 20, 101))  # larger than the whole budget: refused, nothing dropped
    assert tier.num_bytes == 80 and len(tier) == 2


def test_the_ram_tier_keeps_one_copy_of_a_prefix_and_finds_the_longest_share():
    tier = RamTier(max_bytes=None)
    short = saved(list(range(20)), 10)
    longer = saved(list(range(30)), 10)
    assert tier.put(short) and tier.put(longer)
    assert short not in tier and len(tier) == 1  # the longer one restores every prefix of it
    assert tier.put(saved(list(range(25)), 10)) and len(tier) == 1  # covered by what is held
    best, n = tier.best(list(range(26)) + [99])
    assert best is longer and n == 26
    assert tier.best([5, 6, 7]) == (None, 0)


def test_cache_ram_takes_llama_server_s_values():
    assert cache_ram_bytes(-1) is None and cache_ram_bytes(0) == 0 and cache_ram_bytes(3) == 3 * MIB
    with pytest.raises(ValueError, match="-1 .no limit."):
        cache_ram_bytes(-2)
