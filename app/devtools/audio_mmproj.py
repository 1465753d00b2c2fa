"""Random-weight audio projectors (mmproj GGUFs with an audio encoder), so speech is tested without a download.

As app/devtools/mmproj.py does for images: the hyper-parameters, tensor names and shapes are exactly those
llama.cpp's tools/mtmd/clip.cpp loads for the projector type, so libmtmd and stock llama-server load it and
turn audio into embeddings of the text model's width; only the numbers are noise. Two families share the
Whisper encoder (models/whisper-enc.cpp: two 1-D convolutions over the log-mel frames, the second of stride
2, then pre-norm transformer blocks whose k projection has no bias):
  qwen2a    Qwen2-Audio / Qwen2.5-Omni: an average pool of 2, then one linear layer (mm.a.fc);
  ultravox  Ultravox: frames stacked by stack_factor, RMS norm, a swapped SwiGLU MLP (mm.a.mlp.1/2).
libmtmd computes the log-mel spectrogram itself (16 kHz, n_fft 400, hop 160, 30 s chunks): a 30 s chunk is
3,000 frames, 1,500 positions after the stride-2 convolution, so the position table holds 1,500 rows.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGUFType, VisionProjectorType

from app.devtools.mmproj import cached_projector, text_embedding_length, write_random_tensors

# Positions after the stride-2 convolution of one 30 s chunk (3,000 mel frames); clip.cpp asserts the table
# holds at least the chunk's.
WHISPER_POSITIONS = 1500
SAMPLE_RATE = 16000
CHUNK_SECONDS = 30


@dataclass(frozen=True)
class AudioShape:
    """The hyper-parameters that decide an audio projector's tensors (the text width comes from the model)."""

    name: str
    family: str  # "qwen2a" or "ultravox"
    n_mel: int
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    stack_factor: int = 0  # ultravox only
    n_proj_ff: int = 0  # ultravox only: the width of the MLP's hidden layer (after the SwiGLU halves it)
    eps: float = 1e-5

    def tokens_for_seconds(self, seconds: float) -> int:
        """Embeddings a clip of this many seconds becomes: libmtmd pads the audio to whole 30 s chunks."""
        frames = CHUNK_SECONDS * SAMPLE_RATE // 160
        per_chunk = -(-frames // self.stack_factor) // 2 if self.family == "ultravox" else frames // 2 // 2
        return max(1, math.ceil(seconds / CHUNK_SECONDS)) * per_chunk

    def tensors(self, n_embd_text: int) -> list[tuple[str, tuple[int, ...]]]:
        """(name, numpy shape) of every tensor, in file order; numpy shapes are ggml's ne reversed."""
        e = self.n_embd
        out: list[tuple[str, tuple[int, ...]]] = [
            # ggml_conv_1d_ph kernels: ne [kernel, in, out]; the biases broadcast over time, so ne [1, out].
            ("a.conv1d.1.weight", (e, self.n_mel, 3)), ("a.conv1d.1.bias", (e, 1)),
            ("a.conv1d.2.weight", (e, e, 3)), ("a.conv1d.2.bias", (e, 1)),
            ("a.position_embd.weight", (WHISPER_POSITIONS, e)),
        ]
        for i in range(self.n_layer):
            b = f"a.blk.{i}."
            out += [
                (b + "attn_q.weight", (e, e)), (b + "attn_q.bias", (e,)),
                (b + "attn_k.weight", (e, e)),  # Whisper's k projection has no bias (whisper-enc.cpp asserts it)
                (b + "attn_v.weight", (e, e)), (b + "attn_v.bias", (e,)),
                (b + "attn_out.weight", (e, e)), (b + "attn_out.bias", (e,)),
                (b + "ln1.weight", (e,)), (b + "ln1.bias", (e,)),
                (b + "ln2.weight", (e,)), (b + "ln2.bias", (e,)),
                (b + "ffn_up.weight", (self.n_ff, e)), (b + "ffn_up.bias", (self.n_ff,)),
                (b + "ffn_down.weight", (e, self.n_ff)), (b + "ffn_down.bias", (e,)),
            ]
        out += [("a.post_ln.weight", (e,)), ("a.post_ln.bias", (e,))]
        if self.family == "qwen2a":
            out += [("mm.a.fc.weight", (n_embd_text, e)), ("mm.a.fc.bias", (n_embd_text,))]
        else:
            stacked = e * self.stack_factor
            out += [
                ("mm.a.norm_pre.weight", (stacked,)),
                ("mm.a.mlp.1.weight", (2 * self.n_proj_ff, stacked)),
                ("mm.a.norm_mid.weight", (self.n_proj_ff,)),
                ("mm.a.mlp.2.weight", (n_embd_text, self.n_proj_ff)),
            ]
        return out


AUDIO_SHAPES = {
    s.name: s
    for s in (
        # Whisper-style encoders as small as clip.cpp allows: two blocks of width 64 over 128 mel bins (Whisper
        # large-v3's, which Qwen2-Audio and Ultravox use); a 30 s chunk becomes 750 (qwen2a) or 375 (ultravox)
        # embeddings. Ultravox stacks 4 frames, not its checkpoints' 8: the pinned clip.cpp counts 3,000 / 8 / 2 =
        # 187 tokens a chunk but its graph makes 1,500 / 8 = 188 and aborts the server (seen with stock llama-server).
        # Under 2 MiB, encode in tens of milliseconds.
        AudioShape("mmproj-qwen2a-tiny", "qwen2a", n_mel=128, n_embd=64, n_ff=128, n_layer=2, n_head=4),
        AudioShape("mmproj-ultravox-tiny", "ultravox", n_mel=128, n_embd=64, n_ff=128, n_layer=2, n_head=4,
                   stack_factor=4, n_proj_ff=128),
        # Whisper-base-sized (6 blocks of 512, 2,048 ff): an encode that costs something on a CPU, for measuring
        # the voice class's TTFT while audio encodes (~100 MB in f32).
        AudioShape("mmproj-qwen2a-base", "qwen2a", n_mel=128, n_embd=512, n_ff=2048, n_layer=6, n_head=8),
    )
}

_PROJECTOR_TYPES = {"qwen2a": VisionProjectorType.QWEN2A, "ultravox": VisionProjectorType.ULTRAVOX}


def _is_norm_weight(name: str) -> bool:
    return name.endswith(("ln1.weight", "ln2.weight", "post_ln.weight", "norm_pre.weight", "norm_mid.weight"))


def make_audio_mmproj(shape: AudioShape, text_model: str | Path, path: str | Path, seed: int = 0) -> dict:
    """Write a random-weight audio projector of this shape for text_model to path; returns what was written."""
    n_embd_text = text_embedding_length(text_model)
    t0 = time.monotonic()
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(tmp), "clip")
    w.add_type(GGUFType.MMPROJ)
    w.add_name(f"random {shape.name}")
    w.add_description(f"random weights of a {shape.family} audio projector's shape, made by hearth's "
                      "app/devtools/audio_mmproj.py")
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_clip_projector_type(_PROJECTOR_TYPES[shape.family])
    w.add_clip_has_vision_encoder(False)
    w.add_clip_has_audio_encoder(True)
    w.add_audio_projection_dim(n_embd_text)
    w.add_audio_embedding_length(shape.n_embd)
    w.add_audio_feed_forward_length(shape.n_ff)
    w.add_audio_block_count(shape.n_layer)
    w.add_audio_head_count(shape.n_head)
    w.add_audio_attention_layernorm_eps(shape.eps)
    w.add_audio_num_mel_bins(shape.n_mel)
    if shape.family == "ultravox":
        w.add_audio_stack_factor(shape.stack_factor)
    write_random_tensors(w, shape.tensors(n_embd_text), rng, _is_norm_weight)
    tmp.replace(path)
    return {"path": str(path), "shape": asdict(shape), "n_embd_text": n_embd_text,
            "tokens_30s": shape.tokens_for_seconds(30), "file_bytes": path.stat().st_size,
            "seconds": time.monotonic() - t0}


def cached_audio_mmproj(text_model: str | Path, shape_name: str = "mmproj-qwen2a-tiny", seed: int = 0) -> Path:
    """The audio projector for text_model, written into the mmproj cache the first time, then reused."""
    return cached_projector(make_audio_mmproj, shape_name, AUDIO_SHAPES[shape_name], text_model, seed)


def run_from_args(args, text_model: str) -> int:
    """`hearth models random mmproj-qwen2a-…`: write one random audio projector for text_model, print its path."""
    info = make_audio_mmproj(AUDIO_SHAPES[args.shape], text_model, args.out, args.seed)
    print(f"{info['path']}: {args.shape} for {Path(text_model).name} (width {info['n_embd_text']}), "
          f"{info['tokens_30s']} tokens per 30 s of audio, {info['file_bytes'] / 2**20:,.2f} MiB "
          f"in {info['seconds']:.1f} s")
    return 0
