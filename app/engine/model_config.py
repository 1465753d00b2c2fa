"""What a runner loads and how: the llama.cpp model and context settings (no llama.cpp import here)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from app.repack import repack_works


@dataclass(frozen=True)
class ModelConfig:
    """What the runner was asked to load, and how."""

    path: str
    n_ctx: int = 4096
    n_seq_max: int = 4
    n_batch: int = 512
    # Tokens per physical batch (llama-server's -ub; None: min(n_batch, 512)).
    n_ubatch: int | None = None
    # Flash attention: "auto" (llama.cpp decides), "on" or "off" (llama-server's -fa).
    flash_attn: str = "auto"
    # KV cache element types (llama-server's -ctk / -ctv: app.engine.kv_types); a quantized V needs flash attention.
    type_k: str = "f16"
    type_v: str = "f16"
    # Tensor buffer-type overrides (llama-server's -ot, --cpu-moe, --n-cpu-moe), in order: (name pattern, buffer
    # type name such as "CPU" or "Vulkan0"); the first rule a tensor's name matches places it.
    tensor_overrides: tuple[tuple[str, str], ...] = ()
    # Several GPUs (llama-server's --device, --tensor-split, --split-mode, --main-gpu): the devices offloaded layers
    # may use by name (empty: all), their shares of the layers (empty: by free memory), how layers are split.
    devices: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] = ()
    split_mode: str = "layer"
    main_gpu: int = 0
    n_threads: int = max(1, os.cpu_count() or 1)
    n_gpu_layers: int = 0
    # Weight repacking (llama.cpp's "extra buffer types"). None = automatic: off where this build's repack path dies
    # on this CPU, asked of the build by app.repack's probe (the pinned build's AMX path crashes inside llama_decode on
    # a Xeon VM with amx_int8; CPUID alone cannot tell).
    repack: bool | None = None
    verbose: bool = False
    # Logit rows beyond one per sequence that a batch may ask for (speculative decoding's draft tokens).
    n_outputs_extra: int = 0
    # One sequence id beyond the slots and their twins for moving KV states in and out (app/engine/kv_tiers.py).
    kv_transfer: bool = False

    @property
    def repack_enabled(self) -> bool:
        """Whether weight repacking is used; the benchmark passes the same choice to llama.cpp's tools."""
        return self.repack if self.repack is not None else repack_works()


