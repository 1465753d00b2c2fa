"""Fit a model to the GPUs' free memory: context, KV type and offload (layers, or a MoE's experts), with the reason.

The rule follows llama-server's --fit (common/fit.cpp), which measures and then: keeps the defaults when they fit;
shrinks an unset context towards --fit-ctx (4096); fills the GPUs with whole layers from the back (a MoE's dense
parts of every layer first, its experts kept in RAM, then experts moved to the GPUs from the front). Hearth counts
instead of measuring (app.residency.estimate and app.residency.placement, as pure functions of a device list), and
before shrinking the context it tries the KV cache in q8_0 (17/32 of f16's bytes; `hearth bench kv-types`
measures its cost) where the admin chose no type. Each GPU keeps a margin free (llama-server's --fit-target,
1024 MiB by default).

The compute buffer is the CPU-calibrated estimate (app.residency.estimate, flash attention on), plus, without
flash attention, the attention scores of a micro-batch (heads × cells × n_ubatch floats) on the GPU when the device
may hold a tensor that large. llama-server's --fit measures instead (a no-alloc load); Hearth counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from app.devices import Device
from app.engine.kv_types import DEFAULT_KV_TYPE
from app.residency.budget import ANY_GPU, most_room
from app.residency.catalog import CatalogEntry
from app.residency.estimate import KV_CELL_PADDING, MAX_UBATCH, MIB, estimate_memory
from app.residency.placement import CPU, DeviceSplit, moe_overrides, runner_overrides, split_by_device

# llama-server's --fit-target default: the memory each GPU keeps free.
FIT_MARGIN_BYTES = 1024 * MIB
# llama-server's --fit-ctx default: the smallest context an unset one is shrunk to.
FIT_MIN_CTX = 4096
SMALLER_KV = "q8_0"


@dataclass(frozen=True)
class FitChoice:
    """What the fit chose, how it lays out, and why (in the admin's words, for the Models page)."""

    n_ctx: int
    n_gpu_layers: int
    n_cpu_moe: int  # experts of the first N layers kept in RAM
    type_k: str
    type_v: str
    split: DeviceSplit
    fits: bool
    reason: str
    budgets: dict[str, int] = field(default_factory=dict)


def _split(entry: CatalogEntry, tensors, gpus, n_ctx: int, parallel: int, n_batch: int, kv: str, ngl: int,
           n_cpu_moe: int, n_outputs_extra: int = 0, flash_attn: bool = True) -> DeviceSplit:
    est = estimate_memory(entry, n_ctx, parallel, n_batch, type_k=kv, type_v=kv, n_outputs_extra=n_outputs_extra)
    split = split_by_device(tensors, entry.n_layers or 0, est.kv_bytes, est.compute_bytes, gpus, ngl,
                            moe_overrides(n_cpu_moe=n_cpu_moe))
    if flash_attn or not entry.n_head:
        return split
    # Without flash attention the attention scores of a micro-batch are one f32 tensor of heads × cells × tokens,
    # on the GPU where the device may hold it (else llama.cpp computes attention on the CPU): 128 MiB of a 16-head
    # shape at 4096 cells on lavapipe's Vulkan0, 256 MiB of a 32-head one in RAM (282 MiB host).
    cells = -(-n_ctx // KV_CELL_PADDING) * KV_CELL_PADDING
    ubatch = min(n_batch, MAX_UBATCH)
    scores = entry.n_head * cells * ubatch * 4
    gpu = next((d for d in split.compute if d != CPU), None)
    limit = next((g.max_tensor_bytes for g in gpus if g.name == gpu), None)
    where = gpu if gpu is not None and (limit is None or scores <= limit) else CPU
    compute = dict(split.compute)
    compute[where] = max(compute.get(where, 0), attention_peak_bytes(entry.n_head, entry.n_embd or 0, cells, ubatch))
    return replace(split, compute=compute)


def attention_peak_bytes(n_head: int, n_embd: int, cells: int, ubatch: int) -> int:
    """A layer's compute buffer at its peak without flash attention: the scores (f32, heads × cells × tokens), the
    mask (f32 without flash attention: llama-graph's build_attn_inp_kq_mask, cells × tokens) and what lives beside
    them (the residual, the queries, the attention's output: 4.5 f32 rows of the width a token, ggml's allocator
    included, and 64 KiB of small inputs). Checked against lavapipe's "Vulkan0 compute buffer size" lines,
    llama-server -fa off, 512-token micro-batch: 1024 wide, 16 heads at 2048/3072/4096 cells 77.06/111.06/145.06 MiB
    (this gives the same to 0.01 MiB); 2048 wide, 16 heads, 4096 cells 152.25 (this gives 154.06)."""
    return n_head * cells * ubatch * 4 + cells * ubatch * 4 + 9 * ubatch * n_embd * 2 + 64 * 1024


def _fits(split: DeviceSplit, budgets: dict[str, int]) -> bool:
    return all(split.total(d) <= b for d, b in budgets.items())


def fit_runner(entry: CatalogEntry, tensors: Sequence[tuple[str, int]], devices: Sequence[Device], parallel: int,
               n_batch: int = 512, n_ctx: int | None = None, kv_type: str | None = None,
               margin_bytes: int = FIT_MARGIN_BYTES, min_ctx: int = FIT_MIN_CTX,
               n_outputs_extra: int = 0, flash_attn: bool = True) -> FitChoice:
    """The context, KV type and offload that fit the GPUs among `devices` (each keeps `margin_bytes` free).

    `n_ctx` None: the fit chooses, from the trained context down to `min_ctx`; `kv_type` None: f16, or q8_0 when
    that fits more. `n_outputs_extra`: logit rows reserved beyond one per slot (a hearth runner's draft rows).
    Without a GPU, or when nothing fits, the choice runs on the CPU and says so."""
    gpus = [d for d in devices if d.is_gpu]
    n_layer = entry.n_layers or 0
    all_layers = n_layer + 1
    budgets = {g.name: max(0, g.free_bytes - margin_bytes) for g in gpus}
    wanted = n_ctx or entry.n_ctx_train or min_ctx
    floor = min(wanted, min_ctx) if n_ctx is None else n_ctx
    # A quantized V needs flash attention (llama.cpp refuses the context otherwise, app.engine.kv_types): without it
    # (a runner on lavapipe) the fit never reaches for q8_0, or the runner it sizes would not start.
    kv_types = [kv_type] if kv_type else [DEFAULT_KV_TYPE, SMALLER_KV] if flash_attn else [DEFAULT_KV_TYPE]
    moe = any(name.endswith("_exps.weight") for name, _ in tensors)

    def choice(ctx, ngl, ncm, kv, why, fits=True):
        split = _split(entry, tensors, gpus, ctx, parallel, n_batch, kv, ngl, ncm, n_outputs_extra, flash_attn)
        return FitChoice(ctx, ngl, ncm, kv, kv, split, fits, why, budgets)

    if not gpus:
        return choice(wanted, 0, 0, kv_types[0], "no GPU: the model runs on the CPU")
    room = ", ".join(f"{g.name} {budgets[g.name] / MIB:,.0f} MiB" for g in gpus)
    # 1. Everything on the GPUs at the wanted context, f16 then q8_0 KV.
    for kv in kv_types:
        if _fits(_split(entry, tensors, gpus, wanted, parallel, n_batch, kv, all_layers, 0, n_outputs_extra, flash_attn), budgets):
            extra = "" if kv == kv_types[0] else f", the KV cache in {kv} (f16 would not fit)"
            return choice(wanted, all_layers, 0, kv, f"every layer on the GPU ({room} free beyond the margin) at "
                          f"{wanted:,} cells{extra}")
    # 2. Everything on the GPUs at a smaller context (unset context only), the largest that fits.
    kv = kv_types[-1]
    if n_ctx is None and wanted > floor:
        lo, hi = floor, wanted
        if _fits(_split(entry, tensors, gpus, lo, parallel, n_batch, kv, all_layers, 0, n_outputs_extra, flash_attn), budgets):
            while hi - lo > KV_CELL_PADDING:
                mid = (lo + hi) // 2 // KV_CELL_PADDING * KV_CELL_PADDING
                if _fits(_split(entry, tensors, gpus, mid, parallel, n_batch, kv, all_layers, 0, n_outputs_extra, flash_attn), budgets):
                    lo = mid
                else:
                    hi = mid
            return choice(lo, all_layers, 0, kv, f"every layer on the GPU ({room}): the context shrunk from "
                          f"{wanted:,} to {lo:,} cells, KV {kv}")
    ctx = floor
    # 3. A MoE: every layer's dense part on the GPUs, the experts of the first N layers in RAM, N as small as fits.
    if moe:
        for ncm in range(n_layer + 1):
            if _fits(_split(entry, tensors, gpus, ctx, parallel, n_batch, kv, all_layers, ncm, n_outputs_extra, flash_attn), budgets):
                return choice(ctx, all_layers, ncm, kv, f"every layer on the GPU, the experts of the first {ncm} of "
                              f"{n_layer} in RAM (--n-cpu-moe {ncm}; {room}), {ctx:,} cells, KV {kv}")
    # 4. Whole layers from the back, as many as fit.
    for ngl in range(all_layers - 1, 0, -1):
        if _fits(_split(entry, tensors, gpus, ctx, parallel, n_batch, kv, ngl, 0, n_outputs_extra, flash_attn), budgets):
            return choice(ctx, ngl, 0, kv, f"{ngl} of {all_layers} layers on the GPU (-ngl {ngl}; {room}), the rest "
                          f"on the CPU, {ctx:,} cells, KV {kv}")
    return choice(ctx, 0, 0, kv, f"not one layer fits the GPU ({room}): the model runs on the CPU", fits=False)


def place_on(devices: Sequence[Device], need: dict[str, int], used: dict[str, int] | None = None) -> str | None:
    """Of the GPUs, the one with the most room left that holds `need` (a single-device split's bytes, keyed by the
    device it was laid out for, or by "GPU"), given the bytes `used` there by resident models; None if none does.
    Lavapipe-like devices that report no usage are charged only what Hearth placed (`used`)."""
    used = used or {}
    want = sum(v for k, v in need.items() if k != CPU)
    rooms = {d.name: d.free_bytes if d.reports_usage else d.total_bytes - used.get(d.name, 0) for d in devices if d.is_gpu}
    return most_room(want, rooms)


def device_need(entry: CatalogEntry, tensors: Sequence[tuple[str, int]], runner, total_bytes: int,
                kv_bytes: int, compute_bytes: int, devices: Sequence[Device],
                margin_bytes: int = FIT_MARGIN_BYTES) -> dict[str, int]:
    """A runner's bytes per device for the budget per device: its GPU parts as placement lays them out (compute
    included), the rest of `total_bytes` in RAM ("CPU"). Where the admin named no device and the GPU part fits one
    GPU whole (beside `margin_bytes`), it is keyed ANY_GPU: the residency puts it on the GPU with room (--device)."""
    gpus = [d for d in devices if d.is_gpu]
    if runner.devices:
        gpus = [d for d in gpus if d.name in runner.devices]
    if not gpus or not runner.gpu_layers or not entry.n_layers:
        return {CPU: total_bytes}
    n_layer = entry.n_layers
    overrides = runner_overrides(runner.n_cpu_moe, runner.extra_args)
    movable = not runner.devices and not runner.tensor_split and runner.split_mode != "row"
    if movable:
        # Laid out on the GPU with the most room: the same bytes whichever GPU the residency picks.
        roomiest = max(gpus, key=lambda g: (g.free_bytes, g.name))
        split = split_by_device(tensors, n_layer, kv_bytes, compute_bytes, [roomiest], runner.gpu_layers, overrides)
        on_gpu = split.total(roomiest.name)
        if on_gpu <= max(g.free_bytes for g in gpus) - margin_bytes or len(gpus) == 1:
            return {CPU: max(0, total_bytes - on_gpu), ANY_GPU: on_gpu}
    split = split_by_device(tensors, n_layer, kv_bytes, compute_bytes, gpus, runner.gpu_layers, overrides,
                            runner.tensor_split, runner.split_mode, runner.main_gpu)
    parts = {d: split.total(d) for d in split.devices if d != CPU}
    return {CPU: max(0, total_bytes - sum(parts.values())), **parts}
