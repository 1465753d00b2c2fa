"""Random-weight GGUFs of real model shapes, so big-model throughput is measured without downloading weights.

The file has exactly the tensors, types and sizes llama.cpp would load for the real model
(Llama 3.2 1B, Llama 3.1 8B), so its decode costs what the real one costs; only the numbers
in it are noise. Its tokenizer is a made-up SentencePiece vocabulary of the real size (byte
fallback, so any text tokenizes): the text it generates means nothing, so benchmarks run it
with ignore_eos for fixed output lengths.

Tensors are written one at a time from a small pool of random blocks repeated, never the
whole model in memory: an 8B F16 file (16 GB) needs about the largest tensor's size (1 GB).

A model may also take its vocabulary from another GGUF (read_tokenizer: a real tokenizer, e.g. one of
llama.cpp's models/ggml-vocab-*.gguf) and a chat template of its own: app/devtools/family_models.py
makes the model families' test doubles that way.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, LlamaFileType, TokenType

from app.gguf_meta import read_typed_fields

ARCH = "llama"
# Standard deviation of the weights: a usual initialisation, so activations neither vanish nor overflow f16.
WEIGHT_STD = 0.02
POOL_BYTES = 16 * 1024 * 1024
TYPES = {"q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
         "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16)}
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    """The hyper-parameters that decide a llama-architecture model's tensors."""

    name: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int
    rope_theta: float
    tied_embeddings: bool  # no output.weight: the token embedding is reused (Llama 3.2 1B/3B)
    # Mixture of experts: the llama.cpp architecture ("qwen3moe", "gpt-oss"), experts per layer, experts a token
    # uses, and one expert's feed-forward size; 0 experts is a dense llama.
    arch: str = ARCH
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    head_dim_override: int = 0  # Qwen3 and gpt-oss heads are not n_embd / n_head
    n_swa: int = 0  # gpt-oss: sliding-window layers (every other one) of this many tokens

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.head_dim_override or self.n_embd // self.n_head

    def tensors(self) -> list[tuple[str, tuple[int, ...], bool]]:
        """(name, numpy shape rows × columns, quantisable) of every tensor, in file order."""
        e, kv, q = self.n_embd, self.n_head_kv * self.head_dim, self.n_head * self.head_dim
        out: list[tuple[str, tuple[int, ...], bool]] = [("token_embd.weight", (self.n_vocab, e), True)]
        for i in range(self.n_layer):
            b = f"blk.{i}."
            out += [
                (b + "attn_norm.weight", (e,), False),
                (b + "attn_q.weight", (q, e), True),
                (b + "attn_k.weight", (kv, e), True),
                (b + "attn_v.weight", (kv, e), True),
                (b + "attn_output.weight", (e, q), True),
            ]
            if self.arch == "qwen3moe":
                out += [(b + "attn_k_norm.weight", (self.head_dim,), False),
                        (b + "attn_q_norm.weight", (self.head_dim,), False)]
            if self.arch == "gpt-oss":
                out += [(b + "attn_q.bias", (q,), False), (b + "attn_k.bias", (kv,), False),
                        (b + "attn_v.bias", (kv,), False), (b + "attn_output.bias", (e,), False), (b + "attn_sinks.weight", (self.n_head,), False),
                        (b + "post_attention_norm.weight", (e,), False)]
            else:
                out.append((b + "ffn_norm.weight", (e,), False))
            if not self.n_expert:
                out += [
                    (b + "ffn_gate.weight", (self.n_ff, e), True),
                    (b + "ffn_up.weight", (self.n_ff, e), True),
                    (b + "ffn_down.weight", (e, self.n_ff), True),
                ]
                continue
            x, f = self.n_expert, self.n_ff_exp
            # The router stays f32, as converted models have it; the experts are one 3-D tensor each.
            out += [
                (b + "ffn_gate_inp.weight", (x, e), False),
                (b + "ffn_gate_exps.weight", (x, f, e), True),
                (b + "ffn_up_exps.weight", (x, f, e), True),
                (b + "ffn_down_exps.weight", (x, e, f), True),
            ]
            if self.arch == "gpt-oss":
                out += [(b + "ffn_gate_inp.bias", (x,), False), (b + "ffn_gate_exps.bias", (x, f), False),
                        (b + "ffn_up_exps.bias", (x, f), False), (b + "ffn_down_exps.bias", (x, e), False)]
        out.append(("output_norm.weight", (e,), False))
        if not self.tied_embeddings:
            out.append(("output.weight", (self.n_vocab, e), True))
        return out

    @property
    def n_params(self) -> int:
        """Parameters in the file."""
        return sum(int(np.prod(s)) for _, s, _ in self.tensors())


SHAPES = {
    s.name: s
    for s in (
        # From the models' config.json (Meta's Llama 3.2 1B and Llama 3.1 8B).
        Shape("llama-3.2-1b", 128256, 2048, 16, 32, 8, 8192, 131072, 500000.0, True),
        Shape("llama-3.1-8b", 128256, 4096, 32, 32, 8, 14336, 131072, 500000.0, False),
        # Mixture-of-experts layouts (config.json of Qwen3-30B-A3B and gpt-oss-20b): the experts are what
        # --cpu-moe / --n-cpu-moe keep in RAM. gpt-oss ships its experts in MXFP4; these are q8_0 or f16.
        Shape("qwen3-30b-a3b", 151936, 2048, 48, 32, 4, 6144, 40960, 1000000.0, False, arch="qwen3moe",
              n_expert=128, n_expert_used=8, n_ff_exp=768, head_dim_override=128),
        Shape("gpt-oss-20b", 201088, 2880, 24, 64, 8, 2880, 131072, 150000.0, False, arch="gpt-oss",
              n_expert=32, n_expert_used=4, n_ff_exp=2880, head_dim_override=64, n_swa=128),
        # For tests: loads in milliseconds, same code path.
        Shape("tiny", 512, 64, 2, 4, 2, 128, 2048, 10000.0, True),
        Shape("qwen3moe-tiny", 512, 64, 4, 4, 2, 128, 2048, 1000000.0, False, arch="qwen3moe", n_expert=8,
              n_expert_used=2, n_ff_exp=64, head_dim_override=32),
        Shape("gpt-oss-tiny", 512, 64, 4, 4, 2, 64, 2048, 150000.0, False, arch="gpt-oss", n_expert=4,
              n_expert_used=2, n_ff_exp=64, head_dim_override=32, n_swa=128),
    )
}


def vocabulary(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece vocabulary of n_vocab pieces: specials, the 256 byte-fallback tokens, then pieces."""
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    if n_vocab < len(tokens) + 1:
        raise ValueError(f"a vocabulary needs more than {len(tokens)} tokens")
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = ["\u2581"] + [c for c in letters + letters.upper() + "0123456789.,:;!?'\"-()"]
    pieces += ["\u2581" + c for c in letters + letters.upper()]
    pieces += ["\u2581" + a + b for a in letters for b in letters] + [a + b for a in letters for b in letters]
    seen = set(tokens)
    for p in pieces:
        if len(tokens) >= n_vocab:
            break
        if p not in seen:
            seen.add(p)
            tokens.append(p)
            types.append(TokenType.NORMAL)
    i = 0
    while len(tokens) < n_vocab:
        tokens.append(f"\u2581w{i}")
        types.append(TokenType.NORMAL)
        i += 1
    # Later pieces score lower: SentencePiece merges the best-scoring pieces first.
    scores = [0.0] * 5 + [-1000.0] * 256 + [-float(i) for i in range(n_vocab - 261)]
    return tokens, scores, [int(t) for t in types]


TOKENIZER_PREFIX = "tokenizer.ggml."


@dataclass
class Tokenizer:
    """A vocabulary as a GGUF stores it: every tokenizer.ggml.* key with its value and GGUF types."""

    keys: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] = field(default_factory=dict)

    @property
    def tokens(self) -> list[str]:
        """The token texts, by id."""
        return self.keys[TOKENIZER_PREFIX + "tokens"][0]

    @property
    def types(self) -> list[int]:
        """The token types (gguf.TokenType values), by id."""
        return self.keys[TOKENIZER_PREFIX + "token_type"][0]

    @property
    def n_vocab(self) -> int:
        """Tokens in the vocabulary."""
        return len(self.tokens)

    def set(self, key: str, value: Any, vtype: GGUFValueType, sub_type: GGUFValueType | None = None) -> None:
        """Set tokenizer.ggml.<key>."""
        self.keys[TOKENIZER_PREFIX + key] = (value, vtype, sub_type)


def read_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer.ggml.* keys of a GGUF (chat templates and model hyper-parameters left out)."""
    tok = Tokenizer()
    # Hearth's own header reader: gguf.GGUFReader took ~10 s over a 151k-token vocabulary and its merges.
    for key, (value, value_type, item_type) in read_typed_fields(path).items():
        if not key.startswith(TOKENIZER_PREFIX):
            continue
        tok.keys[key] = (list(value) if value_type == GGUFValueType.ARRAY else value, value_type, item_type)
    if TOKENIZER_PREFIX + "tokens" not in tok.keys or TOKENIZER_PREFIX + "token_type" not in tok.keys:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens / token_type to copy")
    return tok


def _write_tokenizer(w: gguf.GGUFWriter, tok: Tokenizer) -> None:
    for key, (value, vtype, sub_type) in tok.keys.items():
        w.add_key_value(key, value, vtype, sub_type)


def _pool(qtype: GGMLQuantizationType, rng: np.random.Generator, size: int) -> np.ndarray:
    """About size bytes of random weights in qtype's layout (whole blocks), as bytes."""
    if qtype == GGMLQuantizationType.F16:
        return rng.normal(0.0, WEIGHT_STD, max(1, size // 2)).astype(np.float16).view(np.uint8)
    if qtype == GGMLQuantizationType.Q8_0:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n = max(1, size // type_size)
        blocks = np.empty((n, type_size), dtype=np.uint8)
        qs = rng.integers(-127, 128, size=(n, block_size), dtype=np.int8)
        # Uniform int8 has a standard deviation of ~73: the scale brings the weights to WEIGHT_STD.
        blocks[:, :2] = np.full(n, WEIGHT_STD / 73.0, dtype=np.float16).view(np.uint8).reshape(n, 2)
        blocks[:, 2:] = qs.view(np.uint8)
        return blocks.reshape(-1)
    raise ValueError(f"no random pool for {qtype.name}")


def _tensor_bytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    if shape[-1] % block_size:
        raise ValueError(f"a row of {shape[-1]} values is no whole number of {qtype.name} blocks")
    return rows * shape[-1] // block_size * type_size


def make_model(shape: Shape, path: str | Path, type_name: str = "q8_0", seed: int = 0,
               tokenizer: Tokenizer | None = None, chat_template: str | None = None) -> dict:
    """Write a random-weight GGUF of this shape to path; returns what was written.

    With a tokenizer, the file carries that vocabulary (shape.n_vocab must be its size) instead of the
    made-up SentencePiece one; chat_template replaces the default ChatML template.
    """
    if tokenizer is not None and tokenizer.n_vocab != shape.n_vocab:
        raise ValueError(f"the shape has {shape.n_vocab} tokens, the tokenizer {tokenizer.n_vocab}")
    qtype, ftype = TYPES[type_name]
    t0 = time.monotonic()
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(tmp), shape.arch)
    w.add_name(f"random {shape.name} ({type_name})")
    w.add_description("random weights of a real model's shape, made by hearth's app/devtools/gguf_shapes.py")
    w.add_file_type(int(ftype))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    if shape.n_expert:
        w.add_expert_count(shape.n_expert)
        w.add_expert_used_count(shape.n_expert_used)
        w.add_expert_feed_forward_length(shape.n_ff_exp)
    if shape.n_swa:
        w.add_sliding_window(shape.n_swa)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape.n_vocab)
    if tokenizer is not None:
        _write_tokenizer(w, tokenizer)
    else:
        tokens, scores, types = vocabulary(shape.n_vocab)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_eot_token_id(4)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
    w.add_chat_template(chat_template if chat_template is not None else CHATML_TEMPLATE)
    plan = []
    for name, tshape, quantisable in shape.tensors():
        t = qtype if quantisable else GGMLQuantizationType.F32
        nbytes = _tensor_bytes(tshape, t)
        byte_shape = (*tshape[:-1], nbytes // (int(np.prod(tshape[:-1])) if len(tshape) > 1 else 1))
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=t)
        plan.append((name, nbytes, t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    pool = _pool(qtype, rng, min(POOL_BYTES, max(n for _, n, _ in plan)))
    ones = np.ones(max(shape.n_embd, 1), dtype=np.float32)
    offset = 0
    for name, nbytes, t in plan:
        if t == GGMLQuantizationType.F32 and name.endswith("norm.weight"):
            # Norm weights: ones, as a freshly initialised RMSNorm.
            w.write_tensor_data(ones[: nbytes // 4])
            continue
        if t == GGMLQuantizationType.F32:
            # Routers, biases and attention sinks: small random floats (a router of equal weights would tie).
            w.write_tensor_data(rng.normal(0.0, WEIGHT_STD, nbytes // 4).astype(np.float32))
            continue
        # The pool repeated from a moving offset: every tensor differs, none needs its own RNG pass.
        start = offset % pool.size
        offset += 7919 * GGML_QUANT_SIZES[t][1]
        data = np.resize(np.roll(pool, -start) if start else pool, nbytes)
        w.write_tensor_data(data)
        del data
    w.close()
    tmp.replace(path)
    return {"path": str(path), "shape": asdict(shape), "type": type_name, "n_params": shape.n_params,
            "file_bytes": path.stat().st_size, "seconds": time.monotonic() - t0}


def run_from_args(args) -> int:
    """`hearth models random`: write one random-weight GGUF and print its path."""
    if args.shape not in SHAPES:
        raise SystemExit(f"hearth: unknown shape {args.shape!r}; choose from {', '.join(SHAPES)}")
    info = make_model(SHAPES[args.shape], args.out, args.type, args.seed)
    print(f"{info['path']}: {info['shape']['name']} {info['type']}, {info['n_params'] / 1e9:.2f} B parameters, "
          f"{info['file_bytes'] / 2**20:,.0f} MiB in {info['seconds']:.1f} s")
    return 0
