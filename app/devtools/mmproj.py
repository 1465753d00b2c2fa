"""Random-weight multimodal projectors (mmproj GGUFs), so images are tested without downloading a vision model.

A projector here has exactly the hyper-parameters, tensor names and shapes that llama.cpp's
tools/mtmd/clip.cpp loads for its projector type (for Gemma 3: a SigLIP-like vision tower, the
average-pool merge and Gemma's input projection), so libmtmd and stock llama-server load it and
turn an image into embeddings of the text model's width. Only the numbers in it are noise: what
the model says about the image means nothing, but both servers must say the same thing.

The output width is read from the text model's GGUF (`<arch>.embedding_length`): libmtmd refuses a
projector whose width differs from the text model's.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType, GGUFType, VisionProjectorType

# Standard deviation of the weights: small, so the random tower's activations stay finite in f32.
WEIGHT_STD = 0.02
# SigLIP's preprocessing (Gemma 3's preprocessor_config.json): pixels to [-1, 1].
IMAGE_MEAN = [0.5, 0.5, 0.5]
IMAGE_STD = [0.5, 0.5, 0.5]
# clip.cpp's Gemma 3 default (4) is the pooling kernel: patches per side / n_merge = tokens per side.
GEMMA3_DEFAULT_MERGE = 4


@dataclass(frozen=True)
class MmprojShape:
    """The hyper-parameters that decide a Gemma 3 projector's tensors (the text width comes from the model)."""

    name: str
    image_size: int
    patch_size: int
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_merge: int = GEMMA3_DEFAULT_MERGE
    eps: float = 1e-6

    @property
    def n_patches(self) -> int:
        """Patches of one image (the tower's sequence length)."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def n_image_tokens(self) -> int:
        """Embeddings one image becomes in the text model's sequence (after the merge)."""
        return (self.image_size // self.patch_size // self.n_merge) ** 2

    def tensors(self, n_embd_text: int) -> list[tuple[str, tuple[int, ...]]]:
        """(name, numpy shape) of every tensor, in file order; numpy shapes are ggml's ne reversed."""
        e, p = self.n_embd, self.patch_size
        out: list[tuple[str, tuple[int, ...]]] = [
            ("v.patch_embd.weight", (e, 3, p, p)),
            ("v.patch_embd.bias", (e,)),
            ("v.position_embd.weight", (self.n_patches, e)),
        ]
        for i in range(self.n_layer):
            b = f"v.blk.{i}."
            for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
                out += [(b + t + ".weight", (e, e)), (b + t + ".bias", (e,))]
            out += [
                (b + "ln1.weight", (e,)), (b + "ln1.bias", (e,)),
                (b + "ln2.weight", (e,)), (b + "ln2.bias", (e,)),
                # up maps n_embd -> n_ff (ne [n_embd, n_ff]); clip.cpp swaps the pair when down's ne[0] is n_embd.
                (b + "ffn_up.weight", (self.n_ff, e)), (b + "ffn_up.bias", (self.n_ff,)),
                (b + "ffn_down.weight", (e, self.n_ff)), (b + "ffn_down.bias", (e,)),
            ]
        out += [
            ("v.post_ln.weight", (e,)), ("v.post_ln.bias", (e,)),
            ("mm.soft_emb_norm.weight", (e,)),
            # Used transposed (siglip.cpp): ne [n_embd_text, n_embd], so the output is n_embd_text wide.
            ("mm.input_projection.weight", (e, n_embd_text)),
        ]
        return out


MMPROJ_SHAPES = {
    s.name: s
    for s in (
        # As small as clip.cpp allows while keeping Gemma 3's default merge: 16×16 patches of 4 px pooled
        # 4×4 into 16 image tokens; two blocks of width 64. Under 1 MiB, encodes in milliseconds.
        MmprojShape("mmproj-gemma3-tiny", image_size=64, patch_size=4, n_embd=64, n_ff=128, n_layer=2, n_head=4),
        # A ViT-B-sized tower (12 blocks of 768, 224 px, patch 14): an encode of about a second on a 2-core
        # CPU, for measuring what an image's encoding costs the sequences decoding beside it (~340 MB in f32).
        MmprojShape("mmproj-gemma3-base", image_size=224, patch_size=14, n_embd=768, n_ff=3072, n_layer=12,
                    n_head=12),
        # Gemma 3 4B's real SigLIP tower (896 px, patch 14, 27 blocks of 1152, 256 image tokens): an
        # encode costs what the real one costs, for measuring the pause an image causes (~1.6 GB in f32).
        MmprojShape("mmproj-gemma3-siglip", image_size=896, patch_size=14, n_embd=1152, n_ff=4304, n_layer=27,
                    n_head=16),
    )
}


def text_embedding_length(model_path: str | Path) -> int:
    """The text model's embedding width (`<arch>.embedding_length` of its GGUF)."""
    reader = gguf.GGUFReader(str(model_path))
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{arch}.embedding_length")
    if field is None:
        raise ValueError(f"{model_path}: no {arch}.embedding_length")
    return int(field.contents())


def make_mmproj(shape: MmprojShape, text_model: str | Path, path: str | Path, seed: int = 0) -> dict:
    """Write a random-weight Gemma 3 projector of this shape for text_model to path; returns what was written."""
    n_embd_text = text_embedding_length(text_model)
    t0 = time.monotonic()
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(tmp), "clip")
    w.add_type(GGUFType.MMPROJ)
    w.add_name(f"random {shape.name}")
    w.add_description("random weights of a Gemma 3 projector's shape, made by hearth's app/devtools/mmproj.py")
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_clip_projector_type(VisionProjectorType.GEMMA3)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(n_embd_text)
    w.add_vision_image_size(shape.image_size)
    w.add_vision_patch_size(shape.patch_size)
    w.add_vision_embedding_length(shape.n_embd)
    w.add_vision_feed_forward_length(shape.n_ff)
    w.add_vision_block_count(shape.n_layer)
    w.add_vision_head_count(shape.n_head)
    w.add_vision_attention_layernorm_eps(shape.eps)
    w.add_vision_use_gelu(True)
    w.add_vision_image_mean(IMAGE_MEAN)
    w.add_vision_image_std(IMAGE_STD)
    if shape.n_merge != GEMMA3_DEFAULT_MERGE:
        w.add_vision_projector_scale_factor(shape.n_merge)
    write_random_tensors(w, shape.tensors(n_embd_text), rng, _is_norm_weight)
    tmp.replace(path)
    return {"path": str(path), "shape": asdict(shape), "n_embd_text": n_embd_text,
            "n_image_tokens": shape.n_image_tokens, "file_bytes": path.stat().st_size,
            "seconds": time.monotonic() - t0}


def _is_norm_weight(name: str) -> bool:
    return name.endswith("norm.weight") or name.endswith(("ln1.weight", "ln2.weight", "post_ln.weight"))


def write_random_tensors(w: gguf.GGUFWriter, tensors, rng: np.random.Generator, is_norm) -> None:
    """A projector's tensors as a fresh model has them (norms 1, biases 0, the rest N(0, WEIGHT_STD)), written and
    closed: the image and the audio projector makers alike."""
    for name, tshape in tensors:
        if is_norm(name):
            data = np.ones(tshape, dtype=np.float32)
        elif name.endswith(".bias"):
            data = np.zeros(tshape, dtype=np.float32)
        else:
            data = rng.normal(0.0, WEIGHT_STD, tshape).astype(np.float32)
        w.add_tensor(name, data, raw_dtype=GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def cache_dir() -> Path:
    """Where cached projectors are kept ($HEARTH_MMPROJ_CACHE, else ~/.cache/hearth/mmproj)."""
    return Path(os.environ.get("HEARTH_MMPROJ_CACHE") or "~/.cache/hearth/mmproj").expanduser()


def cached_mmproj(text_model: str | Path, shape_name: str = "mmproj-gemma3-tiny", seed: int = 0) -> Path:
    """The projector for text_model, written into the cache the first time, then reused.

    The file name carries a hash of the shape, the seed, the text width and this module's writer
    version, so a changed shape never reuses a stale file.
    """
    return cached_projector(make_mmproj, shape_name, MMPROJ_SHAPES[shape_name], text_model, seed)


def cached_projector(make, shape_name: str, shape, text_model: str | Path, seed: int) -> Path:
    """`make(shape, text_model, path, seed)`'s projector, written into the cache under a name that hashes the
    shape, the seed and the text width the first time, then reused (the image and the audio makers alike)."""
    n_embd_text = text_embedding_length(text_model)
    key = json.dumps({"shape": asdict(shape), "seed": seed, "n_embd_text": n_embd_text, "v": 1}, sort_keys=True)
    path = cache_dir() / f"{shape_name}-{n_embd_text}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        make(shape, text_model, path, seed)
    return path


def run_from_args(args, text_model: str) -> int:
    """`hearth models random mmproj-…`: write one random projector for text_model and print its path."""
    if args.shape not in MMPROJ_SHAPES:
        raise SystemExit(f"hearth: unknown image projector shape {args.shape!r}; choose from {', '.join(MMPROJ_SHAPES)}")
    info = make_mmproj(MMPROJ_SHAPES[args.shape], text_model, args.out, args.seed)
    print(f"{info['path']}: {args.shape} for {Path(text_model).name} (width {info['n_embd_text']}), "
          f"{info['n_image_tokens']} tokens an image, {info['file_bytes'] / 2**20:,.2f} MiB "
          f"in {info['seconds']:.1f} s")
    return 0
