"""Random projectors: the keys and tensors clip.cpp reads, the text model's width, the cache, and stock
llama-server answering an image through one."""

from __future__ import annotations

import pytest

from app.cli import main
from app.devtools import mmproj
from app.devtools.gguf_shapes import SHAPES
from app.llama_tools import stock_llama_server
from tests.e2e.test_compat_http import _stock_server
from tests.helpers import gguf_fields
from tests.images import data_url, image_bytes, image_message


def test_the_projector_has_clip_cpps_gemma3_keys_and_the_text_models_width(tiny_text, tmp_path):
    shape = mmproj.MMPROJ_SHAPES["mmproj-gemma3-tiny"]
    info = mmproj.make_mmproj(shape, tiny_text, tmp_path / "p.gguf")
    fields, tensors = gguf_fields(tmp_path / "p.gguf")
    assert fields["general.architecture"] == "clip"
    assert fields["clip.projector_type"] == "gemma3"
    assert fields["clip.has_vision_encoder"] is True
    assert fields["clip.vision.projection_dim"] == info["n_embd_text"] == SHAPES["tiny"].n_embd
    # ggml's ne order: the input projection is [n_embd_text, n_embd], used transposed.
    assert tensors["mm.input_projection.weight"] == [SHAPES["tiny"].n_embd, shape.n_embd]
    assert tensors["v.patch_embd.weight"] == [shape.patch_size, shape.patch_size, 3, shape.n_embd]
    assert tensors["v.position_embd.weight"] == [shape.n_embd, shape.n_patches]
    # up and down are not swapped by clip.cpp: down's ne[0] is n_ff, not n_embd.
    assert tensors["v.blk.0.ffn_down.weight"] == [shape.n_ff, shape.n_embd]
    assert f"v.blk.{shape.n_layer - 1}.ln2.weight" in tensors and f"v.blk.{shape.n_layer}.ln1.weight" not in tensors
    assert shape.n_image_tokens == 16
    assert info["file_bytes"] < 2 * 2**20


def test_the_cache_writes_once_per_text_width(tiny_text, tmp_path, monkeypatch):
    monkeypatch.setenv("HEARTH_MMPROJ_CACHE", str(tmp_path / "cache"))
    first = mmproj.cached_mmproj(tiny_text)
    mtime = first.stat().st_mtime_ns
    assert mmproj.cached_mmproj(tiny_text) == first and first.stat().st_mtime_ns == mtime
    assert "-64-" in first.name


def test_models_random_writes_an_mmproj_shape(tiny_text, tmp_path, capsys):
    out = tmp_path / "mmproj-x.gguf"
    assert main(["models", "random", "mmproj-gemma3-tiny", str(out), "--text-model", str(tiny_text)]) == 0
    assert "16 tokens an image" in capsys.readouterr().out
    assert gguf_fields(out)[0]["clip.vision.projection_dim"] == 64
    with pytest.raises(SystemExit, match="unknown projector shape"):
        main(["models", "random", "mmproj-nope", str(out), "--text-model", str(tiny_text)])


def test_stock_llama_server_answers_an_image_through_the_projector(gemma_path, tmp_path):
    binary = stock_llama_server()
    if binary is None:
        pytest.skip("stock llama-server is not built (scripts/build_llama_tools.sh)")
    projector = mmproj.cached_mmproj(gemma_path)
    assert gguf_fields(projector)[0]["clip.vision.projection_dim"] == 640
    proc, client = _stock_server(binary, gemma_path, tmp_path / "llama-server.log", "--mmproj", str(projector))
    try:
        text = "What is in this image?"
        body = {"max_tokens": 4, "temperature": 0}
        with_image = client.post("/v1/chat/completions", json={
            **body, "messages": [image_message(text, data_url(image_bytes()))]}).json()
        text_only = client.post("/v1/chat/completions", json={
            **body, "messages": [{"role": "user", "content": text}]}).json()
    finally:
        client.close()
        proc.stop()
    n_image = mmproj.MMPROJ_SHAPES["mmproj-gemma3-tiny"].n_image_tokens
    # The image's embeddings plus its <start_of_image> / <end_of_image> markers (and the blank lines around them).
    assert with_image["usage"]["prompt_tokens"] >= text_only["usage"]["prompt_tokens"] + n_image + 2
    assert with_image["usage"]["completion_tokens"] == 4
