"""Where a model's weights and KV cache land across devices: llama.cpp's rules, as pure functions of a device list.

The layers a runner offloads (-ngl) go to the GPUs in proportion to --tensor-split (by default each GPU's free
memory), the last layers first (llama.cpp's i_gpu_start = n_layer + 1 − ngl: the output layer counts as one); the
token embedding stays in RAM; --split-mode none puts every offloaded layer on --main-gpu. Tensor overrides (-ot,
--cpu-moe, --n-cpu-moe) then move the tensors whose names match to another buffer type, the first matching rule
winning (llama_model_loader). The KV cache of a layer lives on its layer's device (llama.cpp's offload_kqv).

Tests pass made-up device lists (app.devices.Device): two GPUs on a box with none.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from app.devices import Device
from app.gguf_meta import read_metadata

CPU = "CPU"
# llama.cpp's LLM_FFN_EXPS_REGEX (common.h): the sparse experts' up, down and gate tensors of a MoE layer.
EXPERT_PATTERN = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
SPLIT_MODES = ("none", "layer", "row")
_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class TensorOverride:
    """One -ot rule: tensors whose name matches `pattern` (a regex search, as std::regex_search) go to `target`,
    a buffer type's name ("CPU", "Vulkan0", "CUDA1")."""

    pattern: str
    target: str

    @property
    def flag(self) -> str:
        """The rule as -ot takes it."""
        return f"{self.pattern}={self.target}"


def moe_overrides(cpu_moe: bool = False, n_cpu_moe: int = 0) -> list[TensorOverride]:
    """--cpu-moe (every layer's experts in RAM) or --n-cpu-moe N (the first N layers'), as llama-server adds them."""
    if n_cpu_moe < 0:
        raise ValueError(f"--n-cpu-moe must be 0 or more (got {n_cpu_moe})")
    if cpu_moe:
        return [TensorOverride(EXPERT_PATTERN, CPU)]
    return [TensorOverride(rf"blk\.{i}{EXPERT_PATTERN}", CPU) for i in range(n_cpu_moe)]


def parse_overrides(text: str) -> list[TensorOverride]:
    """-ot's value: comma-separated PATTERN=BUFFER_TYPE rules; ValueError names a bad one."""
    rules = []
    for part in text.split(","):
        pattern, eq, target = part.partition("=")
        if not eq or not pattern or not target:
            raise ValueError(f"-ot {part!r}: expected <tensor name pattern>=<buffer type>, e.g. exps=CPU")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"-ot {part!r}: the pattern is no regular expression ({exc})") from None
        rules.append(TensorOverride(pattern, target))
    return rules


def layer_devices(n_layer: int, n_gpu_layers: int, gpus: Sequence[Device], tensor_split: Sequence[float] = (),
                  split_mode: str = "layer", main_gpu: int = 0) -> list[str]:
    """The device of each layer 0..n_layer−1 and, last, of the output layer (index n_layer), as llama.cpp assigns
    them (llama_model::load_tensors)."""
    gpus = [g for g in gpus if g.is_gpu]
    if split_mode not in SPLIT_MODES:
        raise ValueError(f"--split-mode {split_mode!r}: choose one of {', '.join(SPLIT_MODES)}")
    if gpus and split_mode == "none":
        if not 0 <= main_gpu < len(gpus):
            raise ValueError(f"--main-gpu {main_gpu}: there are {len(gpus)} GPUs (0 to {len(gpus) - 1})")
        gpus = [gpus[main_gpu]]
        tensor_split = ()
    ngl = n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers
    start = max(n_layer + 1 - ngl, 0)
    active = min(ngl, n_layer + 1) if gpus else 0
    if tensor_split and len(tensor_split) > len(gpus):
        raise ValueError(f"--tensor-split has {len(tensor_split)} parts for {len(gpus)} GPUs")
    weights = list(tensor_split) + [0.0] * (len(gpus) - len(tensor_split)) if tensor_split else []
    if not any(weights):
        weights = [float(g.free_bytes) for g in gpus]  # llama.cpp's default: each GPU's free memory
    total = sum(weights) or 1.0
    bounds, acc = [], 0.0
    for w in weights:
        acc += w
        bounds.append(acc / total)
    out = []
    for il in range(n_layer + 1):
        if il < start or il - start >= active:
            out.append(CPU)
            continue
        frac = (il - start) / active
        # std::upper_bound: the first split point above the layer's fraction.
        idx = next((i for i, b in enumerate(bounds) if b > frac), len(gpus) - 1)
        out.append(gpus[idx].name)
    return out


def tensor_layer(name: str, n_layer: int) -> int | None:
    """The layer a tensor belongs to: its block, n_layer for the output layer, None for the input (embedding)."""
    m = _LAYER.match(name)
    if m:
        return int(m.group(1))
    if name.startswith(("output", "output_norm")):
        return n_layer
    return None


def weights_by_device(tensors: Iterable[tuple[str, int]], n_layer: int, devices: Sequence[str],
                      overrides: Sequence[TensorOverride] = (),
                      max_tensor_bytes: dict[str, int | None] | None = None) -> dict[str, int]:
    """Bytes of weights per device: each tensor on its layer's device (`devices` from layer_devices), unless an
    override matches its name first. A model without output.weight (tied embeddings) gets a copy of the token
    embedding on the output layer's GPU (llama.cpp's TENSOR_DUPLICATED: 33 MiB more on Vulkan0 for a 32k × 1024
    q8_0 embedding), unless it is larger than that device's `max_tensor_bytes` (lavapipe: a 266 MiB embedding stays
    in RAM, -ngl 14 of a Llama 3.2 1B shape puts 13 layers of 61.6 MiB there and nothing more)."""
    out: dict[str, int] = {}
    compiled = [(re.compile(o.pattern), o.target) for o in overrides]
    names = set()
    embd = 0
    for name, nbytes in tensors:
        names.add(name)
        if name == "token_embd.weight":
            embd = nbytes
        layer = tensor_layer(name, n_layer)
        device = CPU if layer is None else devices[layer]
        device = next((target for rx, target in compiled if rx.search(name)), device)
        out[device] = out.get(device, 0) + nbytes
    out_dev = devices[n_layer]
    limit = (max_tensor_bytes or {}).get(out_dev)
    if "output.weight" not in names and out_dev != CPU and embd and (limit is None or embd <= limit):
        out[out_dev] = out.get(out_dev, 0) + embd
    return out


def expert_bytes(tensors: Iterable[tuple[str, int]]) -> int:
    """Bytes of the sparse experts (what --cpu-moe keeps in RAM)."""
    rx = re.compile(EXPERT_PATTERN)
    return sum(n for name, n in tensors if rx.search(name))


def kv_by_device(kv_bytes: int, n_layer: int, devices: Sequence[str]) -> dict[str, int]:
    """The KV cache per device: each layer's share on its layer's device."""
    out: dict[str, int] = {}
    if n_layer < 1:
        return {CPU: kv_bytes}
    for il in range(n_layer):
        out[devices[il]] = out.get(devices[il], 0) + kv_bytes // n_layer
    return out


def model_tensors(path) -> tuple[tuple[str, int], ...]:
    """(name, bytes) of every tensor of a GGUF, from its header (cached while the file is unchanged)."""
    st = os.stat(path)
    return _model_tensors(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _model_tensors(path: str, _size: int, _mtime_ns: int) -> tuple[tuple[str, int], ...]:
    return tuple((t.name, t.n_bytes) for t in read_metadata(path).tensors)


@dataclass(frozen=True)
class DeviceSplit:
    """A runner's memory per device: weights, KV cache and compute buffers, by device name ("CPU" is RAM)."""

    weights: dict[str, int]
    kv: dict[str, int]
    compute: dict[str, int]
    expert_bytes: int = 0  # the sparse experts, wherever they are

    @property
    def devices(self) -> list[str]:
        """Every device with something on it, CPU first."""
        names = set(self.weights) | set(self.kv) | set(self.compute)
        return sorted(names, key=lambda n: (n != CPU, n))

    def total(self, device: str) -> int:
        """Bytes on one device."""
        return self.weights.get(device, 0) + self.kv.get(device, 0) + self.compute.get(device, 0)


def runner_overrides(n_cpu_moe: int, extra_args: Sequence[str] = ()) -> list[TensorOverride]:
    """The override rules a runner applies: runner_args' -ot ones first, then the experts' (the model's n_cpu_moe,
    -1 all), as the runner orders them (app.runner.command.placement_config)."""
    rules: list[TensorOverride] = []
    args = list(extra_args)
    for i, a in enumerate(args):
        flag, eq, inline = a.partition("=") if a.startswith("--override-tensor=") else (a, "", "")
        if flag in ("-ot", "--override-tensor"):
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                rules += parse_overrides(value)
            except ValueError:
                pass  # the runner refuses it and does not start: nothing to place
    if "--cpu-moe" in args or "-cmoe" in args:
        n_cpu_moe = -1
    return rules + moe_overrides(cpu_moe=n_cpu_moe < 0, n_cpu_moe=max(n_cpu_moe, 0))


def split_by_device(tensors: Sequence[tuple[str, int]], n_layer: int, kv_bytes: int, compute_bytes: int,
                    gpus: Sequence[Device], n_gpu_layers: int, overrides: Sequence[TensorOverride] = (),
                    tensor_split: Sequence[float] = (), split_mode: str = "layer", main_gpu: int = 0) -> DeviceSplit:
    """Weights, KV and compute per device for a runner with these placement settings on these GPUs. The compute
    buffer is counted on the first device holding a layer (llama.cpp reserves one per backend; the largest is the
    GPU's, the CPU's host part small)."""
    devices = layer_devices(n_layer, n_gpu_layers, gpus, tensor_split, split_mode, main_gpu)
    weights = weights_by_device(tensors, n_layer, devices, overrides, {g.name: g.max_tensor_bytes for g in gpus})
    kv = kv_by_device(kv_bytes, n_layer, devices)
    on_gpu = next((d for d in devices if d != CPU), CPU)
    return DeviceSplit(weights, kv, {on_gpu: compute_bytes}, expert_bytes(tensors))
