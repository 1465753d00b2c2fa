"""The host-RAM KV tier on the real Gemma 3 270M GGUF (sliding window of 512 tokens), in-process.

A stable system prompt of ~1,300 tokens spans three of the sliding window's saving windows, so a restore
that lost the SWA layers' older cells (llama.cpp leaves slid-out cells out of a sequence's state) would
change the logits; they are compared exactly, with the prefix kept in the KV cache as the reference.
"""

import llama_cpp
import pytest

from app.engine.engine import Engine
from app.engine.llama_model import LlamaModel
from app.engine.model_config import ModelConfig
from app.engine.request import Delta, Finished, SamplingParams
from tests.helpers import house_system_prompt

pytestmark = pytest.mark.model

SYSTEM = house_system_prompt(4)
OTHER = "A story about the sea, told slowly. " + " ".join(f"Wave {i} rolls in and out again." for i in range(150))


@pytest.fixture(scope="module")
def model(gemma_path):
    # 2,048 cells: one long prompt's cached cells leave too little room for a second long prompt.
    m = LlamaModel(ModelConfig(path=str(gemma_path), n_ctx=2048, n_seq_max=2, n_batch=512, n_threads=2,
                               kv_transfer=True))
    yield m
    m.close()


def answer(engine: Engine, model: LlamaModel, prompt: str, max_tokens: int = 12):
    """One greedy completion with logprobs: (text, the logprob entries, cached prompt tokens)."""
    r = engine.submit(model.tokenize(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3))
    text, probs, fin = "", [], None
    for ev in engine.events(r):
        if isinstance(ev, Delta):
            text += ev.text
            if ev.logprob is not None:
                probs.append(ev.logprob)
        elif isinstance(ev, Finished):
            fin = ev
    assert fin is not None and fin.error is None
    return text, probs, fin.stats.num_cached_tokens


def session(model: LlamaModel, cache_ram_bytes, evict: bool):
    """First turn, (another long prompt that needs the first turn's cells), second turn: the answers."""
    llama_cpp.llama_memory_clear(model._memory, True)
    engine = Engine(model, cache_ram_bytes=cache_ram_bytes).start()
    try:
        first = answer(engine, model, f"{SYSTEM}\nUser: Count with me: 1, 2, 3, 4,")
        if evict:
            answer(engine, model, OTHER, max_tokens=4)
        second = answer(engine, model, f"{SYSTEM}\nUser: Now the months: January, February, March,")
        return first, second, engine.tiers.counters if engine.tiers else None
    finally:
        engine.stop()


def test_a_prefix_restored_from_ram_gives_the_same_tokens_and_logprobs_as_one_kept_in_the_kv_cache(model):
    assert len(model.tokenize(SYSTEM)) > 2 * model.n_swa  # more than two saving windows
    kept_first, kept, _ = session(model, cache_ram_bytes=0, evict=False)
    _, restored, counters = session(model, cache_ram_bytes=None, evict=True)
    _, prefilled, none = session(model, cache_ram_bytes=0, evict=True)
    assert none is None
    n_system = len(model.tokenize(SYSTEM + "\nUser: "))
    # The reference: the second turn shares the system prompt with the first turn's cells, still in the KV cache.
    assert kept[2] >= n_system - 2
    # With the tier: those cells were evicted for the other prompt, saved, and restored.
    assert counters.saves_total >= 1 and counters.hits_total == 1
    assert restored[2] == kept[2] and counters.restored_tokens_total == kept[2]
    assert restored[0] == kept[0] and restored[1] == kept[1]  # tokens and logprobs, exactly
    # Without the tier the evicted prefix is computed again: same greedy answer, nothing cached.
    assert prefilled[2] == 0 and prefilled[0] == kept[0]
    assert kept_first[0]  # the first turn said something
