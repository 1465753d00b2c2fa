"""A tiny llama-architecture GGUF that llama.cpp really loads: random weights, an SPM vocabulary with FIM tokens."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

N_EMBD, N_HEAD, N_FF, N_CTX = 64, 4, 128, 512
FIM = {"pre": "<|fim_prefix|>", "suf": "<|fim_suffix|>", "mid": "<|fim_middle|>"}
_NORMAL, _CONTROL, _BYTE = 1, 3, 6


def write_tiny_model(path: Path, fim: bool = True, seed: int = 0) -> Path:
    """Write the model; with fim, the vocabulary has FIM prefix/suffix/middle control tokens."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, _CONTROL, _CONTROL]
    fim_ids = {}
    if fim:
        for key, text in FIM.items():
            fim_ids[key] = len(tokens)
            tokens.append(text)
            types.append(_CONTROL)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [_BYTE] * 256
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("()=:,.+-*/_0123456789")
    pieces += ["\u2581def", "\u2581return", "\u2581f", "\u2581x"]
    tokens += pieces
    types += [_NORMAL] * len(pieces)
    scores = [0.0] * (len(tokens) - len(pieces)) + [-float(i) for i in range(len(pieces))]
    n_vocab = len(tokens)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-fim" if fim else "tiny")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(1)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    for key, token_id in fim_ids.items():
        w.add_uint32(getattr(gguf.Keys.Tokenizer, f"FIM_{key.upper()}_ID"), token_id)
    rng = np.random.default_rng(seed)

    def t(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    w.add_tensor("token_embd.weight", t(n_vocab, N_EMBD))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.add_tensor("output.weight", t(n_vocab, N_EMBD))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        w.add_tensor(f"blk.0.{name}.weight", t(N_EMBD, N_EMBD))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.add_tensor("blk.0.ffn_gate.weight", t(N_FF, N_EMBD))
    w.add_tensor("blk.0.ffn_up.weight", t(N_FF, N_EMBD))
    w.add_tensor("blk.0.ffn_down.weight", t(N_EMBD, N_FF))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
