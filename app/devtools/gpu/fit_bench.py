"""`hearth bench fit`: Hearth's fit (app.residency.fit) against llama-server's --fit on the same model and memory.

For each --fit-target (the MiB each GPU keeps free) llama-server (a Vulkan build on Mesa's lavapipe, a fixed
2 GiB device) fits an unset context and the offload, and prints its choice; Hearth's fit gets the same device
and margin. Both are compared by the layers on the GPU (a MoE: experts in RAM), the context, and the device bytes;
then llama-server is started with Hearth's choice (--fit off) to show it holds: its buffers on the device (a stock
llama-server's compute buffer reserves logits for a whole micro-batch, which a hearth runner does not).
"""

from __future__ import annotations

import re
from pathlib import Path

from app.devices import Device
from app.devtools.gpu.moe_bench import parse_buffers, run_server
from app.residency.catalog import scan
from app.residency.estimate import MIB
from app.residency.fit import fit_runner
from app.residency.placement import model_tensors

_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_CTX = re.compile(r"llama_context: n_ctx\s*=\s*(\d+)")


def llama_fit(binary: str, model: str, target_mib: int, env: dict[str, str]) -> dict:
    """llama-server's own choice with --fit on and this --fit-target: layers offloaded, context, device buffers."""
    log = run_server(binary, model, ["-np", "1", "-t", "2", "-fa", "off", "--fit", "on", "--fit-target",
                                     str(target_mib), "--no-webui"], env)
    off = _OFFLOADED.search(log)
    ctx = _CTX.search(log)
    buffers = parse_buffers(log)
    device = sum(v for kind in buffers.values() for k, v in kind.items() if k != "CPU")
    return {"ngl": int(off.group(1)) if off else 0, "n_ctx": int(ctx.group(1)) if ctx else 0,
            "device_bytes": device, "log_tail": log[-2000:] if not off else ""}


def hearth_holds(binary: str, model: str, choice, env: dict[str, str]) -> dict[str, dict[str, int]]:
    """llama.cpp's buffers (kind → device → bytes) when started with Hearth's choice (--fit off)."""
    args = ["-np", "1", "-t", "2", "-fa", "off", "--fit", "off", "-c", str(choice.n_ctx), "-ngl",
            str(choice.n_gpu_layers), "--n-cpu-moe", str(choice.n_cpu_moe), "-ctk", choice.type_k, "-ctv",
            choice.type_v, "--no-webui"]
    if choice.type_v != "f16":
        args[args.index("-fa") + 1] = "on"
    return parse_buffers(run_server(binary, model, args, env))


def run_from_args(args) -> int:
    """Entry point of `hearth bench fit`."""
    env = {"GGML_VK_VISIBLE_DEVICES": "0", "LD_LIBRARY_PATH": str(Path(args.llama_server).parent)}
    device = Device("Vulkan0", "Vulkan", "gpu", "llvmpipe", args.device_mib * MIB, args.device_mib * MIB,
                    reports_usage=False,
                    max_tensor_bytes=128 * MIB)
    entry = scan(None, Path(args.model))[0]
    tensors = model_tensors(args.model)
    print(f"{Path(args.model).name}: one {args.device_mib:,} MiB device, 1 slot, context unset; "
          "llama-server --fit on --fit-target T against Hearth's fit with the same margin")
    print(f"{'target MiB':>10} {'llama ngl':>9} {'llama ctx':>9} {'hearth ngl':>10} {'ncmoe':>5} {'hearth ctx':>10} "
          f"{'kv':>5} {'layers %':>8} {'held MiB':>9} {'budget MiB':>10}")
    for target in [int(x) for x in args.targets.split(",")]:
        theirs = llama_fit(args.llama_server, args.model, target, env)
        if theirs["log_tail"]:
            print(theirs["log_tail"])
        # Both without flash attention (it crashes on lavapipe).
        mine = fit_runner(entry, tensors, [device], parallel=1, margin_bytes=target * MIB,
                          kv_type=None if args.kv_auto else "f16", flash_attn=False)
        buffers = hearth_holds(args.llama_server, args.model, mine, env)
        held = sum(v for kind in buffers.values() for k, v in kind.items() if k != "CPU")
        share = mine.n_gpu_layers / theirs["ngl"] if theirs["ngl"] else float("inf")
        print(f"{target:>10} {theirs['ngl']:>9} {theirs['n_ctx']:>9} {mine.n_gpu_layers:>10} {mine.n_cpu_moe:>5} "
              f"{mine.n_ctx:>10} {mine.type_k:>5} {share:>8.0%} {held / MIB:>9.0f} "
              f"{(args.device_mib - target):>10}")
        print(f"           hearth: {mine.reason}")
    return 0
