"""The prefix cache on the real Gemma 3 270M GGUF (sliding window of 512 tokens), in-process."""

import random

import llama_cpp
import pytest

from app.engine.engine import Engine
from app.engine.llama_model import LlamaModel
from app.engine.model_config import ModelConfig
from app.engine.request import Delta, Finished, Request, SamplingParams
from app.engine.scheduler import Chunk
from tests.helpers import house_system_prompt

pytestmark = pytest.mark.model

SYSTEM = house_system_prompt(3)


@pytest.fixture(scope="module")
def model(gemma_path):
    m = LlamaModel(ModelConfig(path=str(gemma_path), n_ctx=4096, n_seq_max=4, n_batch=512, n_threads=2))
    yield m
    m.close()


def answer(engine: Engine, prompt: str, model: LlamaModel, max_tokens: int = 16) -> tuple[str, Finished]:
    """One greedy completion: its text and its Finished event."""
    r = engine.submit(model.tokenize(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0))
    text, fin = "", None
    for ev in engine.events(r):
        if isinstance(ev, Delta):
            text += ev.text
        elif isinstance(ev, Finished):
            fin = ev
    return text, fin


def conversation(engine: Engine, model: LlamaModel) -> list[tuple[str, int]]:
    """Two satellites, two turns each, one after the other: (text, cached tokens) per turn."""
    out = []
    history = {"kitchen": "", "garage": ""}
    # Prompts with clear answers: llama.cpp's CPU kernels are not batch-invariant, and a prefix
    # computed in other chunks (or cells) moves logits by ~0.15 rms, enough to flip a near-tie.
    for question in ("Count with me: 1, 2, 3, 4,", "Now the months: January, February, March,"):
        for area in history:
            prompt = f"{SYSTEM}\nThis satellite is in the {area}.\n{history[area]}User: {question}"
            text, fin = answer(engine, prompt, model, max_tokens=12)
            history[area] += f"User: {question}{text}\n"
            out.append((text, fin.stats.num_cached_tokens))
    return out


def test_the_sliding_window_cache_loses_prefixes_held_by_one_sequence_and_the_guard_keeps_them(model):
    """The measurement behind the guard: llama.cpp overwrites SWA cells that slid out of their only sequence's window."""
    mem = model._memory
    rng = random.Random(1)
    filler = [rng.randrange(1000, 20000) for _ in range(2500)]
    prefix = [rng.randrange(1000, 20000) for _ in range(1200)]

    def feed(seq: int, toks: list[int]) -> None:
        r = Request(prompt_tokens=[1])
        r.slot = seq
        for i in range(0, len(toks), 512):
            assert model.decode([Chunk(r, toks[i : i + 512], i, False)])[0] == 0

    lost = {}
    for guard in (False, True):
        llama_cpp.llama_memory_clear(mem, True)
        feed(2, filler[:1500])  # cells 0..1499, freed below: a hole before the cached prefix
        feed(1, prefix)
        model.seq_cp(1, 100, -1, -1)
        if guard:
            model.seq_cp(1, 101, -1, -1)
        model.seq_rm(1, -1, -1)
        model.seq_rm(2, -1, -1)
        feed(2, filler[500:2500])
        lost[guard] = model.seq_pos_min(100)
    llama_cpp.llama_memory_clear(mem, True)
    assert lost[False] > 0  # positions [0, lost) of the cached prefix are gone from the SWA layers
    assert lost[True] == 0


def test_greedy_output_is_the_same_with_and_without_the_cache(model):
    off = Engine(model, prefix_cache=False).start()
    try:
        expected = conversation(off, model)
    finally:
        off.stop()
    on = Engine(model).start()
    try:
        got = conversation(on, model)
        snap = on.snapshot()
    finally:
        on.stop()
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert all(n == 0 for _, n in expected)
    n_system = len(model.tokenize(SYSTEM))
    assert n_system > 512  # longer than the window: the guard is what makes this reuse correct
    # The second satellite reuses the first one's system prompt; second turns reuse their whole first turn.
    assert got[0][1] == 0 and got[1][1] >= n_system - 2
    assert got[2][1] > got[1][1] and got[3][1] > got[1][1]
    assert snap.prefix_cache and "sliding window of 512" in snap.prefix_cache_note


def test_concurrent_requests_share_a_running_prefix_and_answer_as_if_alone(model):
    prompts = [f"{SYSTEM}\nUser ({room}): {start}" for room, start in
               (("hall", "Count: 1, 2, 3,"), ("office", "Days: Monday, Tuesday,"), ("bedroom", "Letters: A, B, C,"))]
    off = Engine(model, prefix_cache=False).start()
    try:
        alone = [answer(off, p, model)[0] for p in prompts]
    finally:
        off.stop()
    on = Engine(model).start()
    try:
        first = on.submit(model.tokenize(prompts[0]), SamplingParams(max_tokens=16, temperature=0.0))
        # The others arrive once the first has computed its system prompt, while it still runs.
        for ev in on.events(first):
            if isinstance(ev, Delta):
                break
        rest = [on.submit(model.tokenize(p), SamplingParams(max_tokens=16, temperature=0.0)) for p in prompts[1:]]
        texts, cached = [], []
        for r in [first, *rest]:
            text = "".join(ev.text for ev in on.events(r) if isinstance(ev, Delta))
            texts.append(text)
            cached.append(r.num_cached_tokens)
    finally:
        on.stop()
    assert cached[0] == 0 and min(cached[1:]) > 500
    # The first request's text lost its first piece to the loop above.
    assert texts[1:] == alone[1:] and alone[0].endswith(texts[0])


def test_preemption_and_cancellation_with_shared_cells_and_a_new_engine_starts_empty(model):
    small = LlamaModel(ModelConfig(path=model.config.path, n_ctx=1024, n_seq_max=4, n_batch=256, n_threads=2))
    try:
        e = Engine(small).start()
        try:
            system = small.tokenize(SYSTEM)[:600]
            reqs = [e.submit(system + small.tokenize(f" Question {i}:", add_special=False),
                             SamplingParams(max_tokens=220, temperature=0.0, ignore_eos=True)) for i in range(3)]
            cancelled = e.submit(system + small.tokenize(" Cancel me", add_special=False),
                                 SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
            for ev in e.events(cancelled):
                if isinstance(ev, Delta):
                    e.cancel(cancelled)
            fins = [next(ev for ev in e.events(r) if isinstance(ev, Finished)) for r in reqs]
            assert all(f.finish_reason == "length" and f.stats.num_completion_tokens == 220 for f in fins)
            assert e.counters.preemptions_total > 0  # 600 shared + 3 × 220 generated cannot fit 1024 cells
            assert sum(f.stats.num_cached_tokens for f in fins) >= 2 * 590
            assert e.scheduler.kv_used == 0 and e.scheduler.kv_cached > 0
        finally:
            e.stop()
        assert all(small.seq_pos_min(s) == -1 for s in range(256))  # the stopped engine gave its cells back
        again = Engine(small).start()
        try:
            r = again.submit(system + [9], SamplingParams(max_tokens=2, temperature=0.0))
            fin = next(ev for ev in again.events(r) if isinstance(ev, Finished))
            assert fin.stats.num_cached_tokens == 0
        finally:
            again.stop()
    finally:
        small.close()
