"""Tests for app.residency.estimate: KV bytes per token and runner footprints against evidence."""

from dataclasses import replace
from pathlib import Path

import pytest

from app.residency.catalog import CatalogEntry, scan
from app.residency.estimate import (
    AUTO_BUDGET_SHARE,
    AUTO_CELLS_PER_SLOT,
    AUTO_SLOTS_CPU,
    AUTO_SLOTS_GPU,
    MemoryEstimate,
    bytes_per_token,
    estimate_memory,
    size_runner,
)

MIB = 1024 * 1024

# What llama.cpp logged and `hearth bench memory` measured for the embedded Gemma 3 270M at
# n_ctx 4096, parallel 8, n_batch 512 (see app/residency/estimate.py).
GEMMA_KV_MIB = 72
GEMMA_COMPUTE_MIB = 25.77
GEMMA_OUTPUT_MIB = 8
GEMMA_IDLE_RSS_MIB = 415
GEMMA_PEAK_RSS_MIB = 472


@pytest.fixture(scope="module")
def gemma(gemma_path):
    """The catalog entry of the embedded Gemma 3 270M."""
    (entry,) = scan(None, gemma_path)
    return entry


def synthetic(**changes):
    """A usable entry with round numbers, for checking the formulas by hand."""
    entry = CatalogEntry(
        name="synthetic", path=Path("/models/synthetic.gguf"), source="folder",
        size_bytes=1000 * MIB, mtime=0.0, usable=True, architecture="llama",
        n_params=1_000_000_000, weights_bytes=900 * MIB, quantization="Q4_K_M",
        n_ctx_train=8192, n_layers=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8,
        head_dim_k=128, head_dim_v=128, n_vocab=128256,
    )
    return replace(entry, **changes)


def test_bytes_per_token_formula():
    # Llama 3 8B shape: 32 layers × 8 KV heads × (128 + 128) × 2 bytes = 128 KiB per token.
    assert bytes_per_token(synthetic()) == 32 * 8 * 256 * 2 == 128 * 1024
    assert bytes_per_token(synthetic(head_dim_v=64)) == 32 * 8 * (128 + 64) * 2
    # q8_0 keys and values: 34 bytes per 32 elements.
    assert bytes_per_token(synthetic(), kv_type_bytes=34 / 32) == 32 * 8 * 256 * 34 // 32
    # Recurrent models have no attention KV cache.
    assert bytes_per_token(synthetic(n_head_kv=0)) == 0


def test_gemma_kv_matches_llama_cpp(gemma):
    # 18 layers × 1 KV head × (256 + 256) × 2 bytes; the 512-token SWA layers count in full.
    assert bytes_per_token(gemma) == 18 * 1 * 512 * 2
    estimate = estimate_memory(gemma, n_ctx=4096, parallel=8, n_batch=512)
    assert estimate.kv_bytes / MIB == pytest.approx(GEMMA_KV_MIB, rel=0.10)


def test_gemma_compute_and_total_match_the_measurements(gemma):
    estimate = estimate_memory(gemma, n_ctx=4096, parallel=8, n_batch=512)
    assert estimate.weights_bytes == gemma.weights_bytes
    assert estimate.compute_bytes / MIB == pytest.approx(
        GEMMA_COMPUTE_MIB + GEMMA_OUTPUT_MIB, rel=0.10
    )
    assert estimate.total_bytes / MIB == pytest.approx(GEMMA_PEAK_RSS_MIB, rel=0.15)
    # A budget reserving less than the idle footprint would over-commit at once.
    assert estimate.total_bytes / MIB > GEMMA_IDLE_RSS_MIB
    parts = (estimate.weights_bytes, estimate.kv_bytes, estimate.compute_bytes,
             estimate.overhead_bytes)
    assert estimate.total_bytes == sum(parts)


def test_gemma_compute_with_a_full_batch_of_logits(gemma):
    # With n_outputs_max = n_batch (512 rows of logits) llama.cpp reserved 514 MiB of compute
    # buffer; compute_bytes also holds the host output buffer of the same 512 rows.
    one_per_slot = estimate_memory(gemma, n_ctx=4096, parallel=8)
    full_batch = estimate_memory(gemma, n_ctx=4096, parallel=512)
    output_buffer_mib = 512 * gemma.n_vocab * 4 / MIB
    assert full_batch.compute_bytes / MIB - output_buffer_mib == pytest.approx(514, rel=0.10)
    assert full_batch.compute_bytes > one_per_slot.compute_bytes


def test_context_is_padded_like_llama_cpp_and_kv_grows_linearly():
    entry = synthetic()
    per_token = bytes_per_token(entry)
    assert estimate_memory(entry, n_ctx=1000, parallel=1).kv_bytes == per_token * 1024
    small = estimate_memory(entry, n_ctx=4096, parallel=4)
    large = estimate_memory(entry, n_ctx=8192, parallel=4)
    assert large.kv_bytes == 2 * small.kv_bytes
    assert large.weights_bytes == small.weights_bytes
    assert large.total_bytes > small.total_bytes


def test_kv_type_bytes_scales_only_the_kv_cache():
    f16 = estimate_memory(synthetic(), n_ctx=4096, parallel=4)
    q8 = estimate_memory(synthetic(), n_ctx=4096, parallel=4, kv_type_bytes=34 / 32)
    assert q8.kv_bytes == pytest.approx(f16.kv_bytes * 34 / 64)
    assert (q8.weights_bytes, q8.compute_bytes) == (f16.weights_bytes, f16.compute_bytes)


def test_missing_feed_forward_size_falls_back_to_four_times_the_embedding():
    assert (
        estimate_memory(synthetic(n_ff=None), 4096, 1).compute_bytes
        == estimate_memory(synthetic(n_ff=4 * 4096), 4096, 1).compute_bytes
    )


def test_unusable_models_and_bad_arguments_are_refused():
    unusable = replace(synthetic(), usable=False, unusable_reason="truncated: …")
    with pytest.raises(ValueError, match="cannot estimate synthetic: truncated"):
        estimate_memory(unusable, 4096, 1)
    for n_ctx, parallel, n_batch in ((0, 1, 512), (4096, 0, 512), (4096, 1, 0)):
        with pytest.raises(ValueError, match="must be positive"):
            estimate_memory(synthetic(), n_ctx, parallel, n_batch)


def test_estimate_is_a_frozen_value():
    estimate = estimate_memory(synthetic(), 4096, 1)
    assert isinstance(estimate, MemoryEstimate)
    with pytest.raises(AttributeError):
        estimate.total_bytes = 0


def test_runner_sizing_gives_a_roomy_box_the_household_overlap():
    entry = synthetic()
    sized = size_runner(entry, 24 * 1024 * MIB)
    assert (sized.parallel, sized.n_ctx) == (AUTO_SLOTS_CPU, AUTO_SLOTS_CPU * AUTO_CELLS_PER_SLOT)
    assert sized.estimate_bytes == estimate_memory(entry, sized.n_ctx, sized.parallel).total_bytes
    assert "8 slots: the household overlap" in sized.reason and "(within the 50% one model may take)" in sized.reason
    assert size_runner(entry, 24 * 1024 * MIB, gpu=True).parallel == AUTO_SLOTS_GPU


def test_runner_sizing_shrinks_to_the_budget_and_says_so():
    entry = synthetic(n_vocab=32000)
    half = size_runner(entry, 4 * 1024 * MIB)
    assert half.parallel < AUTO_SLOTS_CPU and half.estimate_bytes <= 4 * 1024 * MIB * AUTO_BUDGET_SHARE
    assert f"{half.parallel} slots: 8 would not fit the memory budget" in half.reason
    # Nothing fits half the budget: the whole of it, as the only resident model.
    alone = size_runner(entry, 2 * 1024 * MIB)
    assert alone.estimate_bytes <= 2 * 1024 * MIB < 2 * alone.estimate_bytes
    assert "another model evicts it" in alone.reason
    hopeless = size_runner(entry, 512 * MIB)
    assert hopeless.parallel == 1 and "1 slot: 8 would not" in hopeless.reason and "does NOT fit" in hopeless.reason


def test_runner_sizing_keeps_what_the_admin_set_and_the_trained_context():
    entry = synthetic(n_ctx_train=512)
    sized = size_runner(entry, 24 * 1024 * MIB, parallel=2)
    assert (sized.parallel, sized.n_ctx) == (2, 2 * 512)  # a slot never holds more than the trained context
    assert "slots:" not in sized.reason  # only the sized value is explained
    assert size_runner(synthetic(), 24 * 1024 * MIB, n_ctx=2048).n_ctx == 2048
    assert size_runner(synthetic(), 24 * 1024 * MIB, n_batch=4).parallel == 4  # never more slots than the batch
