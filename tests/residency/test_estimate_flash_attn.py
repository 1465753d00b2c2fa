"""The estimate's compute buffer without flash attention (lavapipe runs it off): the scores are materialised."""

from app.devtools.gguf_shapes import SHAPES, make_model
from app.residency.catalog import scan
from app.residency.estimate import estimate_memory

MIB = 1024 * 1024


def test_without_flash_attention_the_attention_scores_set_the_compute_buffer(tmp_path):
    make_model(SHAPES["tiny"], tmp_path / "tiny.gguf")
    entry = scan(None, tmp_path / "tiny.gguf")[0]
    on = estimate_memory(entry, 512, 1)
    off = estimate_memory(entry, 512, 1, flash_attn=False)
    # llama.cpp logged a 5.38 MiB Vulkan0 compute buffer for this model, context and micro-batch with -fa off.
    assert abs(off.compute_bytes / MIB - 5.38) < 0.1
    assert off.compute_bytes > on.compute_bytes and off.total_bytes - on.total_bytes == off.compute_bytes - on.compute_bytes
