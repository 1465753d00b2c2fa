"""Memory a runner needs for a model: weights + KV cache + compute buffers + process overhead.

The model mirrors how the pinned llama.cpp (llama-cpp-python 0.3.36) sizes a context the way
app.engine.llama_model creates it: one unified KV cache of n_ctx cells shared by all slots,
n_ubatch = min(n_batch, 512), n_outputs_max = parallel (+ the draft tokens one iteration may verify
when speculative decoding is on: ModelConfig.n_outputs_extra = draft_max), flash attention on wherever the backend
supports it (llama.cpp's "auto", which includes the CPU), and full-size sliding-window caches.

Calibration (Gemma 3 270M Q4_K_M, n_ctx 4096, parallel 8, n_batch 512, CPU, 2 threads):
llama.cpp logged KV 72 MiB, compute buffer 25.77 MiB, output buffer 8 MiB; `hearth bench memory`
measured the runner worker at 415 MiB RSS idle and 472 MiB at its peak under 8 concurrent
requests, for 235 MiB of weights. With n_outputs_max = n_batch the compute buffer was 514 MiB
(commit ca9c986), which pins down the logits term below.

Vision projectors (projector_compute_bytes; random Gemma 3 projectors of `hearth models random`'s shapes and
four more written with app.devtools.mmproj, CPU, flash attention on as clip.cpp's warmup chooses): stock
llama-server logged clip's compute buffer as 0.47 MiB (tiny: 64 px, patch 4, width 64, ff 128), 8.62 (base:
224 px, patch 14, width 768, ff 3072), 1.19 (112 px, width 256, ff 1024), 3.45 (448 px, width 64, ff 128),
13.25 (448 px, width 512, ff 2048), 13.78 (896 px, width 128, ff 256). The largest two phases fit all six
within 2 %: the patch embedding (the f32 image and its f16 im2col: exact for the 448 and 896 px towers of
width 64 and 128) and a block (5.45 × patches × width + width × ff / 3 + 526 × width floats); the number of
blocks does not matter (ggml reuses a block's memory for the next). `hearth bench vision --memory-only
--memory-projectors ...` measured the runner worker's RSS with the projector less without it: after the load
file + 6 to 25 MiB (the buffer is only partly touched before the first encode), and after one image of the tower's
own size (a noise PNG) against a text runner after one request: file + buffer + 10.7 (tiny), 14.9 (base),
11.1 (112 px), 30.3 and 30.0 (448 px), 64.6 MiB (896 px). 16 MiB + 64 bytes per pixel of the tower's image
size covers those within -2.1 / +5.7 MiB; estimate against measured after the image (a second run): 17.2 /
12.0 MiB (tiny), 356.5 / 352.4 (base), 25.2 / 19.5 (112 px), 32.5 / 34.5 and 57.9 / 60.0 (448 px), 81.9 / 79.9
(896 px). An image sent larger than the tower's size is decoded at its own
size first (Pillow, transiently; libmtmd's stb_image gets at most 2048 px a side, 8 bits a channel): the request's
decoded-pixel budget (--image-max-request-pixels, 8.4 MP) bounds it, which the estimate does not count: the 16-bit
2896² PNG that fills the budget peaked 97 MiB above the estimate and left the runner within it
(app.devtools.engine.image_memory, app/runner/images.py).
"""

import functools
import os
from dataclasses import dataclass, replace

from app.engine.kv_types import DEFAULT_KV_TYPE, KV_TYPE_BYTES
from app.gguf_meta import GgufError, read_metadata
from app.residency.catalog import CatalogEntry

MIB = 1024 * 1024

# llama.cpp pads the context to a multiple of 256 cells (llama-context.cpp, GGML_PAD(n_ctx, 256)).
KV_CELL_PADDING = 256
# Micro-batch cap the engine sets (app/engine/llama_model.py: n_ubatch = min(n_batch, 512)).
MAX_UBATCH = 512
FLOAT32_BYTES = 4
# Flash attention takes an f16 mask of n_kv × n_ubatch per attention kind (llama-graph.cpp).
MASK_BYTES = 2
# Feed-forward size assumed when a GGUF omits it: 4 × n_embd, the classic transformer ratio.
DEFAULT_FF_RATIO = 4
# A layer's live float32 activations per token, in units of n_ff and n_embd (fitted, see below).
LAYER_FF_ACTIVATIONS = 4
LAYER_EMBD_ACTIVATIONS = 2

# RSS of a Python process that has imported the runner (llama_cpp, numpy, jinja2, werkzeug,
# gunicorn, pydantic, app.runner.app): 63 MiB, measured with psutil on this project's venv.
RUNNER_BASELINE_BYTES = 64 * MIB
# Peak minus idle RSS of the calibration run, less the compute and output buffers that are
# first touched when decoding starts: 472 − 415 − 25.77 − 8 ≈ 23 MiB of request state, HTTP
# threads and allocator arenas while 8 requests are served.
SERVING_HEADROOM_BYTES = 24 * MIB
# The rest of the idle RSS, 415 − 235 (weights) − 72 (KV, cleared hence resident at load) − 63
# (Python) = 45 MiB, is llama.cpp's vocabulary (per-token text, score and attributes plus the
# text→id map) and small model state; over Gemma's 262,144 tokens that is ~180 bytes a token.
VOCAB_BYTES_PER_TOKEN = 180

# Gemma 3's merge (clip.cpp's default when the header names no projector.scale_factor): 4×4 patches a token.
DEFAULT_VISION_MERGE = 4
# The vision tower's compute buffer (projector_compute_bytes; the calibration is in the module docstring).
VISION_IM2COL_BYTES = 2  # f16
VISION_PATCH_ACTIVATIONS = 5.45
VISION_FF_DIVISOR = 3
VISION_EMBD_FLOATS = 526
# RSS after the first image beyond the weights and the buffer (fitted, see the calibration).
MTMD_CONTEXT_BYTES = 16 * MIB
IMAGE_BYTES_PER_PIXEL = 64


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated resident bytes of a runner, by part; total_bytes is what a budget reserves."""

    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    overhead_bytes: int
    total_bytes: int
    # The paired vision projector's weights (its file; an image's positions are KV cells like tokens', so
    # they are in kv_bytes), and its vision tower's compute buffer plus one image's working set
    # (projector_compute_bytes, from the projector's header; in total_bytes too).
    projector_bytes: int = 0
    projector_compute_bytes: int = 0
    # The RAM tier's budget (--cache-ram): host RAM the runner fills with prompt KV evicted from its KV cache, empty
    # at load, so the footprint grows towards it as the household's prompts are evicted. Unbounded (-1) cannot be
    # counted: 0 here, and ram_tier_unbounded says so.
    ram_tier_bytes: int = 0
    ram_tier_unbounded: bool = False
    # The draft model the runner loads beside it (-md): its weights, KV for the same cells and compute (in
    # total_bytes too; see with_draft).
    draft_bytes: int = 0

    @property
    def at_load_bytes(self) -> int:
        """The footprint right after a load, before the RAM tier holds anything: what a load's measured RSS checks."""
        return self.total_bytes - self.ram_tier_bytes


def bytes_per_token(entry: CatalogEntry, kv_type_bytes: float = 2.0) -> int:
    """Returns KV-cache bytes per cell: layers × KV heads × (K + V head sizes) × element size."""
    # Sliding-window layers count at full size: llama.cpp's default swa_full=True with a
    # unified cache gives the SWA cache as many cells as the base one (llama-kv-cache-iswa.cpp).
    # Models without attention KV (recurrent ones) come out as 0; their per-sequence state is
    # small and not counted. MLA models (deepseek2) cache less than this, so it over-estimates.
    if not entry.n_layers or not entry.n_head_kv or not entry.head_dim_k:
        return 0
    head_dims = entry.head_dim_k + (entry.head_dim_v or entry.head_dim_k)
    return round(entry.n_layers * entry.n_head_kv * head_dims * kv_type_bytes)


def kv_bytes_per_cell(entry: CatalogEntry, type_k: str = DEFAULT_KV_TYPE, type_v: str = DEFAULT_KV_TYPE) -> float:
    """KV-cache bytes per cell with these cache types (-ctk/-ctv): K and V heads each at their type's size."""
    if not entry.n_layers or not entry.n_head_kv or not entry.head_dim_k:
        return 0
    k = entry.head_dim_k * KV_TYPE_BYTES[type_k]
    v = (entry.head_dim_v or entry.head_dim_k) * KV_TYPE_BYTES[type_v]
    return entry.n_layers * entry.n_head_kv * (k + v)


def with_draft(estimate: MemoryEstimate, draft: CatalogEntry, n_ctx: int, parallel: int,
               n_batch: int = 512) -> MemoryEstimate:
    """A runner's estimate with its draft model added: the draft's own context has the target's cells and slots
    (app.engine.draft_model), so it is estimated as a runner of its own with those settings, at load."""
    extra = estimate_memory(draft, n_ctx, parallel, n_batch).at_load_bytes
    return replace(estimate, draft_bytes=extra, total_bytes=estimate.total_bytes + extra)


def estimate_memory(
    entry: CatalogEntry,
    n_ctx: int,
    parallel: int,
    n_batch: int = 512,
    kv_type_bytes: float = 2.0,
    n_outputs_extra: int = 0,
    ram_tier_mib: int = 0,
    flash_attn: bool = True,
    type_k: str = DEFAULT_KV_TYPE,
    type_v: str = DEFAULT_KV_TYPE,
) -> MemoryEstimate:
    """Estimates a runner's footprint for n_ctx cells shared by `parallel` slots.

    `n_outputs_extra`: logit rows the runner reserves beyond one per slot (a hearth runner that drafts
    reserves its draft_max: app.residency.runner_spec.RunnerSpec.n_outputs_extra). `ram_tier_mib`: its RAM
    tier's budget (RunnerSpec.ram_tier_mib; -1 no limit, 0 none), counted whole: the runner may fill it.
    `type_k`/`type_v`: the KV cache types (-ctk/-ctv, app.engine.kv_types); q8_0 is 17/32 of f16's bytes."""
    if not entry.usable or entry.weights_bytes is None:
        reason = entry.unusable_reason or "no header facts"
        raise ValueError(f"cannot estimate {entry.name}: {reason}")
    if n_ctx < 1 or parallel < 1 or n_batch < 1:
        raise ValueError(
            f"n_ctx, parallel and n_batch must be positive (got {n_ctx}, {parallel}, {n_batch})"
        )
    if n_outputs_extra < 0:
        raise ValueError(f"n_outputs_extra must be 0 or more (got {n_outputs_extra})")
    if ram_tier_mib < -1:
        raise ValueError(f"ram_tier_mib must be -1 (no limit), 0 (none) or a size in MiB (got {ram_tier_mib})")
    ram_tier_bytes = max(ram_tier_mib, 0) * MIB
    cells = -(-n_ctx // KV_CELL_PADDING) * KV_CELL_PADDING
    if (type_k, type_v) == (DEFAULT_KV_TYPE, DEFAULT_KV_TYPE):
        kv_bytes = bytes_per_token(entry, kv_type_bytes) * cells
    else:
        kv_bytes = round(kv_bytes_per_cell(entry, type_k, type_v) * cells)
    # Each extra logit row costs n_vocab floats twice: in the compute buffer's logits phase and in the
    # host output buffer (Gemma's 262k vocabulary: 16 draft rows are 32 MiB).
    compute_bytes = _compute_bytes(entry, cells, parallel + n_outputs_extra, min(n_batch, MAX_UBATCH), flash_attn)
    vocab_bytes = VOCAB_BYTES_PER_TOKEN * (entry.n_vocab or 0)
    overhead_bytes = RUNNER_BASELINE_BYTES + SERVING_HEADROOM_BYTES + vocab_bytes
    projector_bytes = _file_bytes(entry.mmproj) if entry.mmproj is not None else 0
    projector_compute = projector_compute_bytes(entry.mmproj, entry.n_embd) if entry.mmproj is not None else 0
    return MemoryEstimate(
        weights_bytes=entry.weights_bytes,
        kv_bytes=kv_bytes,
        compute_bytes=compute_bytes,
        overhead_bytes=overhead_bytes,
        total_bytes=entry.weights_bytes + kv_bytes + compute_bytes + overhead_bytes + projector_bytes
        + projector_compute + ram_tier_bytes,
        projector_bytes=projector_bytes,
        projector_compute_bytes=projector_compute,
        ram_tier_bytes=ram_tier_bytes,
        ram_tier_unbounded=ram_tier_mib == -1,
    )


@dataclass(frozen=True)
class VisionFacts:
    """What a projector's header says of its vision tower (clip.vision.* keys)."""

    image_size: int
    patch_size: int
    n_embd: int
    n_ff: int
    n_layer: int
    n_merge: int

    @property
    def n_patches(self) -> int:
        """Patches of one image: the tower's sequence length."""
        return (self.image_size // self.patch_size) ** 2


def vision_facts(path) -> VisionFacts | None:
    """The vision tower's shape from a projector's header; None when the file cannot be read or says none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _vision_facts(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _vision_facts(path: str, size: int, mtime_ns: int) -> VisionFacts | None:
    # Keyed by size and mtime too: a replaced file is read again (the Models page asks on every render).
    try:
        fields = read_metadata(path).fields
    except (GgufError, OSError):
        return None

    def key(name: str, default: int | None = None) -> int | None:
        value = fields.get(f"clip.vision.{name}", default)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    facts = [key("image_size"), key("patch_size"), key("embedding_length"), key("feed_forward_length"),
             key("block_count"), key("projector.scale_factor", DEFAULT_VISION_MERGE)]
    if any(f is None for f in facts):
        return None
    return VisionFacts(*facts)


def projector_compute_bytes(path, n_embd_text: int | None) -> int:
    """Estimates the memory a projector takes beyond its weights: clip.cpp's compute buffer (reserved at load by
    its warmup) and what encoding one image adds (see the calibration in the module docstring); 0 when its
    header gives no vision tower."""
    v = vision_facts(path)
    if v is None:
        return 0
    p = v.n_patches
    # ggml's allocator reuses memory between the graph's nodes (and from one block to the next, so the
    # number of blocks does not matter): the buffer is the larger of two phases.
    # The patch embedding: the f32 image (3 channels) and its f16 im2col (3·patch² values a patch).
    patch_phase = (3 * v.image_size**2 * FLOAT32_BYTES
                   + p * 3 * v.patch_size**2 * VISION_IM2COL_BYTES)
    # A block: fitted to llama.cpp's logged buffers as live float32 activations of
    # 5.45 × n_patches × n_embd, plus n_embd × n_ff / 3 and 526 × n_embd (see the calibration).
    layer_phase = FLOAT32_BYTES * (VISION_PATCH_ACTIVATIONS * p * v.n_embd + v.n_embd * v.n_ff / VISION_FF_DIVISOR
                                   + VISION_EMBD_FLOATS * v.n_embd)
    buffer = max(patch_phase, layer_phase)
    # Beyond the buffer: libmtmd's context and the encode worker, and one image's copies on its way in (the
    # request's base64, the decoded bytes, Pillow's and stb's pixels, the f32 preprocessed image), counted at
    # the projector's own image size.
    return round(buffer + MTMD_CONTEXT_BYTES + IMAGE_BYTES_PER_PIXEL * v.image_size**2)


def _file_bytes(path) -> int:
    """A file's size, 0 when it cannot be read."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _compute_bytes(entry: CatalogEntry, cells: int, n_outputs: int, n_ubatch: int, flash_attn: bool = True) -> int:
    """Estimates llama.cpp's compute buffer plus its host output buffer."""
    n_embd = entry.n_embd or 0
    n_ff = entry.n_ff or DEFAULT_FF_RATIO * n_embd
    n_vocab = entry.n_vocab or 0
    # ggml's allocator reuses memory between graph nodes, so the buffer is the larger of two
    # phases rather than their sum. Inside a layer: the attention masks (base, plus SWA when the
    # model has it) and a layer's live float32 activations, fitted as 4 × n_ff + 2 × n_embd per
    # token: 26.5 MiB for the calibration run against the 25.77 MiB llama.cpp logged.
    n_masks = 2 if entry.n_swa else 1
    layer_phase = (
        n_masks * cells * n_ubatch * MASK_BYTES
        + n_ubatch * FLOAT32_BYTES * (LAYER_FF_ACTIVATIONS * n_ff + LAYER_EMBD_ACTIVATIONS * n_embd)
    )
    if not flash_attn:
        # Without flash attention (lavapipe) the scores are materialised: n_head × n_kv × n_ubatch float32 (softmax
        # reuses them in place), beside f32 masks and the Q/K/V views of the micro-batch. Measured on lavapipe with
        # the tiny random model (4 heads, 512 cells, ubatch 512, width 64): 5.38 MiB logged, 5.375 here.
        attention_phase = (cells * n_ubatch * FLOAT32_BYTES * ((entry.n_head or 1) + n_masks)
                           + 3 * n_ubatch * n_embd * FLOAT32_BYTES)
        layer_phase = max(layer_phase, attention_phase)
    # At the end: the logits of n_outputs rows over the vocabulary, plus the normed hidden state
    # feeding them; 513 MiB against the 514 MiB logged with n_outputs_max = 512.
    logits_phase = n_outputs * n_vocab * FLOAT32_BYTES + n_ubatch * n_embd * FLOAT32_BYTES
    # The output buffer is separate host memory that receives the logits of every sequence.
    output_bytes = n_outputs * n_vocab * FLOAT32_BYTES
    return max(layer_phase, logits_phase) + output_bytes


# -- runner sizing -------------------------------------------------------------------------------------

# Slots a runner gets when the admin sets none: the household overlap the bench measures (8 requests
# at once), where a CPU's batching gain levels off (docs/measuring: C++ batched decode 1 → 8 sequences
# ≈ 2×); a GPU keeps gaining beyond it.
AUTO_SLOTS_CPU = 8
AUTO_SLOTS_GPU = 16
# KV cells per slot on average (the cache is unified: one long prompt may take more than its share),
# and never fewer cells in all than one long document needs.
AUTO_CELLS_PER_SLOT = 1024
AUTO_MIN_CELLS = 4096
# One model's runner may take this share of the memory budget, so a second model can stay resident.
AUTO_BUDGET_SHARE = 0.5


@dataclass(frozen=True)
class RunnerSizing:
    """Slots and KV cells chosen for a model's runner, with the reason in the admin's words."""

    parallel: int
    n_ctx: int
    estimate_bytes: int
    reason: str


def size_runner(entry: CatalogEntry, budget_bytes: int, n_batch: int = 512, gpu: bool = False,
                parallel: int | None = None, n_ctx: int | None = None, n_outputs_extra: int = 0,
                ram_tier_mib: int = 0, type_k: str = DEFAULT_KV_TYPE, type_v: str = DEFAULT_KV_TYPE) -> RunnerSizing:
    """Slots and KV cells for a runner where the admin set none (parallel / n_ctx None): the household's
    overlap, as far as AUTO_BUDGET_SHARE of the memory budget and the model's trained context allow
    (`n_outputs_extra`: the draft rows of speculative decoding, `ram_tier_mib` the RAM tier, `type_k`/`type_v` the
    KV cache types, as estimate_memory)."""
    trained = entry.n_ctx_train or AUTO_MIN_CELLS
    target = parallel or min(AUTO_SLOTS_GPU if gpu else AUTO_SLOTS_CPU, n_batch)
    options = []
    for p in dict.fromkeys([target] if parallel else [target, target // 2, target // 4, 2, 1]):
        if p < 1:
            continue
        # A slot holds at most the trained context; all slots together get at least AUTO_MIN_CELLS.
        cells = n_ctx or min(max(p * AUTO_CELLS_PER_SLOT, AUTO_MIN_CELLS), trained * p)
        est = estimate_memory(entry, cells, p, n_batch, n_outputs_extra=n_outputs_extra, ram_tier_mib=ram_tier_mib,
                              type_k=type_k, type_v=type_v)
        options.append((p, cells, est.total_bytes, est.at_load_bytes))
    # Within the share one model may take, its RAM tier included; else within the whole budget without the tier
    # (it will be alone, and the catalog gives the tier what is left: app.services.catalog.fit_ram_tier); else the
    # smallest.
    share = int(budget_bytes * AUTO_BUDGET_SHARE)
    p, cells, need, _ = next((o for o in options if o[2] <= share), None) or \
        next((o for o in options if o[3] <= budget_bytes), options[-1])
    why = []
    if parallel is None:
        hw = "a GPU keeps gaining beyond 8" if gpu else "where a CPU's batching gain levels off"
        why.append(f"{p} slots: the household overlap the bench measures (8 at once; {hw})" if p == target
                   else f"{p} slot{'s' if p > 1 else ''}: {target} would not fit the memory budget")
    if n_ctx is None:
        why.append(f"{cells:,} KV cells: {AUTO_CELLS_PER_SLOT:,} per slot, shared, at least {AUTO_MIN_CELLS:,}"
                   f" and at most the trained {trained:,} per slot")
    pct = 100 * need / budget_bytes if budget_bytes else 0
    fit = (f"within the {AUTO_BUDGET_SHARE:.0%} one model may take" if need <= share
           else "more than half: another model evicts it" if need <= budget_bytes else "does NOT fit")
    why.append(f"estimate {need / MIB:,.0f} MiB = {pct:.0f} % of the {budget_bytes / MIB:,.0f} MiB budget ({fit})")
    return RunnerSizing(p, cells, need, "; ".join(why))
