"""KV cache element types as llama-server spells them (-ctk/-ctv), and their size (no llama.cpp import here).

The estimate, the runner's flags and the Models page share this table; app.engine.llama_model maps the names to
ggml's enum. A quantized type stores blocks of 32 values: q8_0 is 32 int8 and one f16 scale, 34 bytes, so
17/32 of f16's size (53 %), not half.
"""

from __future__ import annotations

# Bytes per element: ggml's block size over its values (ggml-common.h's block_* structs).
KV_TYPE_BYTES: dict[str, float] = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
    "q4_1": 20 / 32,
    "iq4_nl": 18 / 32,
    "q5_0": 22 / 32,
    "q5_1": 24 / 32,
}
KV_TYPES = tuple(KV_TYPE_BYTES)
DEFAULT_KV_TYPE = "f16"
# Values a quantized block holds: a head's size must be a multiple of it.
QUANT_BLOCK = 32


def is_quantized(kv_type: str) -> bool:
    """Whether the type stores blocks of QUANT_BLOCK values (every one but f32, f16, bf16)."""
    return kv_type not in ("f32", "f16", "bf16")


def kv_type_problem(type_k: str, type_v: str, flash_attn: str = "auto") -> str | None:
    """Why these cache types cannot be used, or None: an unknown name, or a quantized V without flash attention
    (llama.cpp refuses the context then: V is read transposed, which only the flash-attention kernels do for blocks)."""
    for flag, t in (("-ctk", type_k), ("-ctv", type_v)):
        if t not in KV_TYPE_BYTES:
            return f"{flag} {t!r}: choose one of {', '.join(KV_TYPES)}"
    if is_quantized(type_v) and flash_attn == "off":
        return f"-ctv {type_v} needs flash attention: use -fa on or auto with a quantized V cache"
    return None
