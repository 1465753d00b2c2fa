"""Random-weight GGUFs: real shapes' sizes, and a file llama.cpp loads and the engine generates from."""

from __future__ import annotations

import pytest

from app.devtools.gguf_shapes import SHAPES, make_model, vocabulary
from app.engine.engine import Engine
from app.engine.llama_model import LlamaModel
from app.engine.model_config import ModelConfig
from app.engine.request import Finished, SamplingParams
from app.gguf_meta import read_metadata
from app.residency.catalog import scan
from app.residency.estimate import estimate_memory


@pytest.mark.parametrize(("name", "params"), [
    # Parameter counts of Meta's releases (safetensors, embeddings tied in the 1B).
    ("llama-3.2-1b", 1_235_814_400),
    ("llama-3.1-8b", 8_030_261_248),
    # Qwen3-30B-A3B and gpt-oss-20b as published (gpt-oss: with its attention biases, sinks and expert biases).
    ("qwen3-30b-a3b", 30_532_122_624),
    ("gpt-oss-20b", 20_914_757_184),
])
def test_real_shapes_have_the_real_models_parameter_counts(name, params):
    assert SHAPES[name].n_params == params


def test_the_vocabulary_has_the_asked_size_unique_pieces_and_byte_fallback():
    tokens, scores, types = vocabulary(1000)
    assert len(tokens) == len(scores) == len(types) == 1000
    assert len(set(tokens)) == 1000
    assert "<0x00>" in tokens and "<0xFF>" in tokens


@pytest.mark.parametrize("type_name", ["q8_0", "f16"])
def test_llama_cpp_loads_the_tiny_shape_and_the_engine_generates_fixed_lengths(tmp_path, type_name):
    path = tmp_path / f"tiny-{type_name}.gguf"
    info = make_model(SHAPES["tiny"], path, type_name)
    assert info["file_bytes"] == path.stat().st_size
    meta = read_metadata(path)
    assert meta.architecture == "llama"
    assert meta.arch_value("block_count") == SHAPES["tiny"].n_layer
    entry = scan(None, path)[0]
    assert entry.usable, entry.unusable_reason
    assert estimate_memory(entry, 256, 2).total_bytes > 0
    model = LlamaModel(ModelConfig(path=str(path), n_ctx=256, n_seq_max=2, n_batch=64, n_threads=1))
    try:
        assert model.n_vocab == SHAPES["tiny"].n_vocab
        assert model.describe()["n_params"] == SHAPES["tiny"].n_params
        prompt = model.tokenize("the household server answers")
        engine = Engine(model).start()
        try:
            requests = [engine.submit(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
                        for _ in range(2)]
            finals = [next(e for e in engine.events(r, poll_s=5.0) if isinstance(e, Finished)) for r in requests]
        finally:
            engine.stop()
    finally:
        model.close()
    assert [f.stats.num_completion_tokens for f in finals] == [10, 10]
    assert requests[0].output_tokens == requests[1].output_tokens  # greedy on the same prompt


@pytest.mark.parametrize("name", ["qwen3moe-tiny", "gpt-oss-tiny"])
def test_llama_cpp_loads_the_moe_shapes_and_generates_with_experts_in_ram(tmp_path, name):
    from app.residency.placement import expert_bytes, model_tensors, moe_overrides

    path = tmp_path / f"{name}.gguf"
    make_model(SHAPES[name], path)
    meta = read_metadata(path)
    assert meta.architecture == SHAPES[name].arch and meta.arch_value("expert_count") == SHAPES[name].n_expert
    # The experts are most of a MoE's weights: what --cpu-moe keeps in RAM.
    assert expert_bytes(model_tensors(path)) > 0.5 * meta.weights_bytes
    rules = tuple((r.pattern, r.target) for r in moe_overrides(n_cpu_moe=2))
    model = LlamaModel(ModelConfig(path=str(path), n_ctx=256, n_seq_max=1, n_batch=64, n_threads=1,
                                   tensor_overrides=rules))
    try:
        assert model.architecture == SHAPES[name].arch
        assert model.describe()["n_params"] == SHAPES[name].n_params
        engine = Engine(model).start()
        try:
            r = engine.submit(model.tokenize("the household server"),
                              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
            final = next(e for e in engine.events(r, poll_s=5.0) if isinstance(e, Finished))
        finally:
            engine.stop()
    finally:
        model.close()
    assert final.stats.num_completion_tokens == 6


def test_an_unknown_buffer_type_is_refused_with_the_ones_there_are(tmp_path):
    path = tmp_path / "m.gguf"
    make_model(SHAPES["qwen3moe-tiny"], path)
    with pytest.raises(ValueError, match="unknown buffer type Vulkan7; this llama.cpp has CPU"):
        LlamaModel(ModelConfig(path=str(path), n_ctx=256, n_seq_max=1, tensor_overrides=(("exps", "Vulkan7"),)))

