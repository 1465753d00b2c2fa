"""`hearth bench placement`: the estimate per device against what llama.cpp says it placed, for a random MoE.

A random-weight MoE GGUF (app.devtools.gguf_shapes: a qwen3moe or gpt-oss layout) is loaded by a stock llama-server
with -ngl and --n-cpu-moe N (on the CPU build, or a Vulkan build with GGML_VK_VISIBLE_DEVICES=0 for Mesa's lavapipe),
its buffer lines are read ("CPU_Mapped model buffer size", "Vulkan0 KV buffer size", ...), and each device's
weights and KV are set beside app.residency.placement's split for the same flags and devices.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import replace
from pathlib import Path

from app.devices import Device
from app.devtools.gguf_shapes import SHAPES, make_model
from app.devtools.processes import stop_process
from app.devtools.stock_server import stock_command
from app.residency.catalog import scan
from app.residency.estimate import MIB, estimate_memory
from app.residency.placement import CPU, model_tensors, moe_overrides, split_by_device
from app.residency.supervisor import free_port

_BUFFER = re.compile(r"(\S+) (model|KV|compute) buffer size\s*=\s*([\d.]+) MiB")
# Host-side buffer types count as RAM.
_HOST = ("CPU", "CPU_Mapped", "CPU_REPACK", "Vulkan_Host", "CUDA_Host")
# A bench-sized qwen3moe: about 110 MiB of experts over 8 layers in q8_0, loads in seconds.
BENCH_SHAPE = replace(SHAPES["qwen3moe-tiny"], name="qwen3moe-bench", n_vocab=4096, n_embd=512, n_layer=8,
                      n_head=8, n_head_kv=4, n_ff=1024, n_expert=16, n_ff_exp=512, head_dim_override=64)


def parse_buffers(log: str) -> dict[str, dict[str, int]]:
    """llama.cpp's buffer lines summed by kind ("model", "KV", "compute") and device ("CPU" for host buffers)."""
    out: dict[str, dict[str, int]] = {"model": {}, "KV": {}, "compute": {}}
    for name, kind, mib in _BUFFER.findall(log):
        device = CPU if name in _HOST else name
        out[kind][device] = out[kind].get(device, 0) + round(float(mib) * MIB)
    return out


def run_server(binary: str, model: str, args: list[str], env: dict[str, str]) -> str:
    """Start llama-server until it listens (or fails), stop it, and return its log."""
    port = free_port()
    proc = subprocess.Popen(stock_command(binary, model, "-lv", "4", *args, port=port, same_cache=False, env=env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **env})
    lines: list[str] = []
    deadline = time.monotonic() + 300
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "listening on" in line or time.monotonic() > deadline:
                break
    finally:
        # The pipe closed first: a server blocked writing its log to it could not exit.
        if proc.stdout is not None:
            proc.stdout.close()
        stop_process(proc)
    return "".join(lines)


def compare(binary: str, model: str, gpus: list[Device], ngl: int, n_cpu_moe: int, n_ctx: int,
            env: dict[str, str]) -> list[tuple[str, str, int, int]]:
    """(kind, device, estimate, llama.cpp's) for the weights and KV of every device either side names."""
    log = run_server(binary, model, ["-c", str(n_ctx), "-np", "1", "-t", "2", "-ngl", str(ngl), "--n-cpu-moe",
                                     str(n_cpu_moe), "-fa", "off", "--fit", "off", "--kv-unified", "--no-webui"], env)
    measured = parse_buffers(log)
    if not measured["model"]:
        raise RuntimeError(f"llama-server printed no buffer lines:\n{log[-3000:]}")
    entry = scan(None, Path(model))[0]
    est = estimate_memory(entry, n_ctx, 1)
    tensors = model_tensors(model)
    split = split_by_device(tensors, entry.n_layers or 0, est.kv_bytes, est.compute_bytes, gpus, ngl,
                            moe_overrides(n_cpu_moe=n_cpu_moe))
    rows = []
    for kind, mine in (("model", split.weights), ("KV", split.kv)):
        for device in sorted(set(mine) | set(measured[kind])):
            rows.append((kind, device, mine.get(device, 0), measured[kind].get(device, 0)))
    return rows


def run_from_args(args) -> int:
    """Entry point of `hearth bench placement`."""
    model = args.model
    if not model:
        model = str(Path(args.out_dir) / "qwen3moe-bench.gguf")
        if not Path(model).is_file():
            make_model(BENCH_SHAPE, model)
    env = {}
    gpus: list[Device] = []
    if args.vulkan:
        # lavapipe is a CPU-type device ggml skips unless named; it reports a fixed 2 GiB.
        env = {"GGML_VK_VISIBLE_DEVICES": "0", "LD_LIBRARY_PATH": str(Path(args.llama_server).parent)}
        gpus = [Device("Vulkan0", "Vulkan", "gpu", "llvmpipe", 2048 * MIB, 2048 * MIB, reports_usage=False,
                    max_tensor_bytes=128 * MIB)]
    rows = compare(args.llama_server, model, gpus, args.ngl, args.n_cpu_moe, args.ctx, env)
    print(f"{Path(model).name}: -ngl {args.ngl} --n-cpu-moe {args.n_cpu_moe}, {args.ctx} cells, "
          f"{'Vulkan0 (lavapipe)' if args.vulkan else 'CPU only'}")
    print(f"{'buffer':<7} {'device':<9} {'estimate MiB':>12} {'llama.cpp MiB':>14} {'ratio':>6}")
    for kind, device, mine, theirs in rows:
        ratio = f"{mine / theirs:.3f}" if theirs else "-"
        print(f"{kind:<7} {device:<9} {mine / MIB:>12.2f} {theirs / MIB:>14.2f} {ratio:>6}")
    return 0
