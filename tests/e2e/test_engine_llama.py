"""The engine on the real Gemma 3 270M GGUF, in-process: equivalence with llama-cpp-python, text, stops, KV."""

import llama_cpp
import pytest

from app.engine.engine import Engine
from app.engine.llama_model import LlamaModel
from app.engine.model_config import ModelConfig
from app.engine.request import Delta, Finished, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n",
]


@pytest.fixture(scope="module")
def model(gemma_path):
    m = LlamaModel(ModelConfig(path=str(gemma_path), n_ctx=1024, n_seq_max=4, n_batch=256, n_threads=2))
    yield m
    m.close()


def run(engine: Engine, tokens, **params):
    """Submit one request and return (text, Finished, request)."""
    r = engine.submit(tokens, SamplingParams(**params))
    text, fin = "", None
    for ev in engine.events(r):
        if isinstance(ev, Delta):
            text += ev.text
        elif isinstance(ev, Finished):
            fin = ev
    return text, fin, r


@pytest.fixture()
def serial(model):
    e = Engine(model, mode="serial").start()
    yield e
    e.stop()


def test_greedy_serial_output_equals_llama_cpp_python(gemma_path, model, serial, monkeypatch):
    # The reference must load the weights the way the engine does: weight repacking
    # (extra buffer types) is a model parameter the high-level Llama does not expose.
    default_params = llama_cpp.llama_model_default_params

    def same_params():
        p = default_params()
        p.use_extra_bufts = model.config.repack_enabled
        return p

    monkeypatch.setattr(llama_cpp.llama_cpp, "llama_model_default_params", same_params)
    monkeypatch.setattr(llama_cpp, "llama_model_default_params", same_params)
    # The engine leaves flash attention at llama.cpp's default (auto), which the CPU backend
    # resolves to enabled; the high-level Llama defaults to disabled, so it is asked for.
    ref = llama_cpp.Llama(str(gemma_path), n_ctx=1024, n_batch=256, n_threads=2, flash_attn=True, verbose=False)
    try:
        for prompt in PROMPTS:
            expected = ref.create_completion(prompt, max_tokens=40, temperature=0.0, repeat_penalty=1.0)
            text, fin, _ = run(serial, model.tokenize(prompt), max_tokens=40, temperature=0.0)
            assert text == expected["choices"][0]["text"], prompt
            assert fin.finish_reason == expected["choices"][0]["finish_reason"]
            assert fin.stats.num_completion_tokens == expected["usage"]["completion_tokens"]
            assert fin.stats.num_prompt_tokens == expected["usage"]["prompt_tokens"]
    finally:
        ref.close()


def test_sequences_in_one_batch_do_not_leak_into_each_other(model):
    """Identical prompts sharing batches with a different one must answer identically.

    (Alone-vs-batched equality is not asserted: llama.cpp's CPU kernels are not batch-invariant,
    so a near-tie between two tokens may break differently at another batch size.)
    """
    same = model.tokenize(PROMPTS[0])
    other = model.tokenize(PROMPTS[1])
    e = Engine(model, mode="continuous").start()
    try:
        reqs = [e.submit(t, SamplingParams(max_tokens=24, temperature=0.0)) for t in (same, other, same, same)]
        texts = ["".join(ev.text for ev in e.events(r) if isinstance(ev, Delta)) for r in reqs]
        assert max(it.num_seqs for it in e.iterations) == 4  # they really shared batches
    finally:
        e.stop()
    assert texts[0] == texts[2] == texts[3]
    assert texts[1] != texts[0]


def test_streamed_pieces_never_split_utf8(model, serial):
    prompt = "日本の首都は東京です。富士山は日本で一番高い山です。桜の季節には"
    text, fin, r = run(serial, model.tokenize(prompt), max_tokens=60, temperature=0.0)
    whole = b"".join(model.token_bytes(t) for t in r.output_tokens).decode("utf-8", "replace")
    assert text == whole
    assert fin.stats.num_completion_tokens == 60
    assert any(ord(ch) > 0x7F for ch in text)  # the test exercised multi-byte characters
    # Some Gemma tokens are single UTF-8 bytes of a character: the stream must have held them back.
    assert "\ufffd" not in text


def test_stop_string_ends_generation_before_it(model, serial):
    tokens = model.tokenize("Count: 1, 2, 3, 4, 5,")
    free, _, _ = run(serial, tokens, max_tokens=30, temperature=0.0)
    assert "8" in free, free  # the unconstrained continuation reaches 8
    stopped, fin, _ = run(serial, tokens, max_tokens=30, temperature=0.0, stop=("8",))
    assert fin.finish_reason == "stop"
    assert stopped == free[: free.index("8")]


def test_max_tokens_and_eos_finish_reasons(model, serial):
    _, fin, _ = run(serial, model.tokenize("Hello"), max_tokens=5, temperature=0.0)
    assert (fin.finish_reason, fin.stats.num_completion_tokens) == ("length", 5)


def test_seeded_sampling_is_reproducible(model, serial):
    tokens = model.tokenize("My favourite colour is")
    a = run(serial, tokens, max_tokens=20, temperature=0.9, seed=42)[0]
    b = run(serial, tokens, max_tokens=20, temperature=0.9, seed=42)[0]
    c = run(serial, tokens, max_tokens=20, temperature=0.9, seed=7)[0]
    assert a == b
    assert a != c


def test_penalties_change_greedy_output(model, serial):
    tokens = model.tokenize("Repeat after me: yes yes yes yes")
    plain = run(serial, tokens, max_tokens=20, temperature=0.0)[0]
    penalised = run(serial, tokens, max_tokens=20, temperature=0.0, repeat_penalty=1.5, presence_penalty=1.0)[0]
    assert plain != penalised


def test_cancel_frees_kv_within_an_iteration(model):
    e = Engine(model, mode="continuous").start()
    try:
        r = e.submit(model.tokenize("Tell me a long story."), SamplingParams(max_tokens=500, temperature=0.0,
                                                                            ignore_eos=True))
        for ev in e.events(r):
            if isinstance(ev, Delta) and len(r.output_tokens) >= 3:
                break
        n_before = len(e.iterations)
        e.cancel(r)
        fin = [ev for ev in e.events(r) if isinstance(ev, Finished)][0]
        assert fin.finish_reason == "cancelled"
        snap = e.snapshot()
        assert snap.kv_used == 0 and snap.num_running == 0
        assert len(e.iterations) - n_before <= 1  # freed at the start of the next iteration at the latest
        # The context is usable again at once: the freed cells hold nothing of the old sequence.
        text, fin, _ = run(e, model.tokenize("The capital of France is"), max_tokens=5, temperature=0.0)
        assert fin.finish_reason == "length"
    finally:
        e.stop()


def test_preemption_under_a_tiny_kv_cache_keeps_every_request_whole(gemma_path):
    m = LlamaModel(ModelConfig(path=str(gemma_path), n_ctx=512, n_seq_max=8, n_batch=256, n_threads=2))
    try:
        base = m.tokenize("The history of the bicycle is a history of small improvements. " * 3, add_special=False)
        prompts = [base[i : i + 30] for i in range(8)]
        e = Engine(m, mode="continuous").start()
        try:
            reqs = [e.submit(p, SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)) for p in prompts]
            fins = [[ev for ev in e.events(r) if isinstance(ev, Finished)] for r in reqs]
            extra = [r.events.qsize() for r in reqs]
        finally:
            e.stop()
        assert all(len(f) == 1 for f in fins)  # each finished exactly once
        assert extra == [0] * 8  # and nothing came after its end
        assert [f[0].finish_reason for f in fins] == ["length"] * 8
        assert [len(r.output_tokens) for r in reqs] == [80] * 8
        assert e.counters.preemptions_total > 0
        assert sum(r.num_preemptions for r in reqs) == e.counters.preemptions_total
        assert max(it.kv_used for it in e.iterations) <= m.n_ctx
    finally:
        m.close()
