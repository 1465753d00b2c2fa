"""Random audio projectors: the keys and tensors clip.cpp reads for the Whisper-style families, generated audio
in every format, and stock llama-server answering an input_audio chat through each projector."""

from __future__ import annotations

import base64
import io
import wave

import pytest

from app.cli import main
from app.devtools import audio_files, audio_mmproj
from app.devtools.gguf_shapes import SHAPES
from app.llama_tools import stock_llama_server
from tests.e2e.test_compat_http import _stock_server
from tests.helpers import gguf_fields


def test_the_qwen2a_projector_has_clip_cpps_whisper_keys_and_the_text_models_width(tiny_text, tmp_path):
    shape = audio_mmproj.AUDIO_SHAPES["mmproj-qwen2a-tiny"]
    audio_mmproj.make_audio_mmproj(shape, tiny_text, tmp_path / "a.gguf")
    fields, tensors = gguf_fields(tmp_path / "a.gguf")
    assert fields["clip.projector_type"] == "qwen2a"
    assert fields["clip.has_audio_encoder"] is True and fields["clip.has_vision_encoder"] is False
    assert fields["clip.audio.projection_dim"] == SHAPES["tiny"].n_embd
    assert fields["clip.audio.num_mel_bins"] == 128
    # ggml's ne order: a conv kernel is [kernel, in, out], its bias [1, out]; fc is [n_embd, n_embd_text].
    assert tensors["a.conv1d.1.weight"] == [3, 128, shape.n_embd]
    assert tensors["a.conv1d.1.bias"] == [1, shape.n_embd]
    assert tensors["a.position_embd.weight"] == [shape.n_embd, audio_mmproj.WHISPER_POSITIONS]
    assert tensors["mm.a.fc.weight"] == [shape.n_embd, SHAPES["tiny"].n_embd]
    assert "a.blk.0.attn_k.bias" not in tensors and "a.blk.0.attn_q.bias" in tensors


def test_the_ultravox_projector_stacks_frames_into_a_swiglu_mlp(tiny_text, tmp_path):
    shape = audio_mmproj.AUDIO_SHAPES["mmproj-ultravox-tiny"]
    audio_mmproj.make_audio_mmproj(shape, tiny_text, tmp_path / "u.gguf")
    fields, tensors = gguf_fields(tmp_path / "u.gguf")
    assert fields["clip.projector_type"] == "ultravox"
    assert fields["clip.audio.projector.stack_factor"] == shape.stack_factor
    assert tensors["mm.a.mlp.1.weight"] == [shape.n_embd * shape.stack_factor, 2 * shape.n_proj_ff]
    assert tensors["mm.a.mlp.2.weight"] == [shape.n_proj_ff, SHAPES["tiny"].n_embd]


def test_models_random_writes_an_audio_shape(tiny_text, tmp_path, capsys):
    out = tmp_path / "mmproj-a.gguf"
    assert main(["models", "random", "mmproj-qwen2a-tiny", str(out), "--text-model", str(tiny_text)]) == 0
    assert "750 tokens per 30 s of audio" in capsys.readouterr().out
    assert gguf_fields(out)[0]["clip.audio.projection_dim"] == 64


@pytest.mark.parametrize("fmt", audio_files.FORMATS)
def test_generated_audio_is_a_file_of_its_format(fmt):
    if audio_files.encoders_missing():
        pytest.skip(f"apt-get install {' '.join(audio_files.encoders_missing())}")
    data = audio_files.sweep(fmt, seconds=1.0)
    magic = {"wav": b"RIFF", "flac": b"fLaC", "mp3": (b"ID3", b"\xff\xfb", b"\xff\xf3")}[fmt]
    assert data.startswith(magic)
    if fmt == "wav":
        with wave.open(io.BytesIO(data)) as w:
            assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (16000, 1, 16000)


@pytest.mark.parametrize("shape_name", ["mmproj-qwen2a-tiny", "mmproj-ultravox-tiny"])
def test_stock_llama_server_answers_input_audio_through_the_projector(shape_name, gemma_path, tmp_path):
    binary = stock_llama_server()
    if binary is None:
        pytest.skip("stock llama-server is not built (scripts/build_llama_tools.sh)")
    projector = audio_mmproj.cached_audio_mmproj(gemma_path, shape_name)
    proc, client = _stock_server(binary, gemma_path, tmp_path / "llama-server.log", "--mmproj", str(projector))
    try:
        assert client.get("/props").json()["modalities"]["audio"] is True
        audio = base64.b64encode(audio_files.sweep("wav", seconds=2.0)).decode()
        body = {"max_tokens": 4, "temperature": 0}
        with_audio = client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Transcribe:"},
            {"type": "input_audio", "input_audio": {"data": audio, "format": "wav"}}]}]}).json()
        text_only = client.post("/v1/chat/completions", json={
            **body, "messages": [{"role": "user", "content": "Transcribe:"}]}).json()
    finally:
        client.close()
        proc.stop()
    n_audio = audio_mmproj.AUDIO_SHAPES[shape_name].tokens_for_seconds(2.0)
    assert with_audio["usage"]["prompt_tokens"] >= text_only["usage"]["prompt_tokens"] + n_audio
    assert with_audio["usage"]["completion_tokens"] == 4


def test_hearth_bench_audio_is_registered():
    from app.cli import build_parser

    args = build_parser().parse_args(["bench", "audio", "--formats", "wav", "--seconds", "1"])
    assert (args.bench_command, args.formats, args.seconds, args.shape) == ("audio", "wav", 1.0, "mmproj-qwen2a-tiny")
