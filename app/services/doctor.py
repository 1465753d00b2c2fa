"""`hearth doctor` and the Status page's devices card: what this box offers Hearth (the llama.cpp build the runners
load, the devices its backends see, NVML's and the kernel's GPU readings) and what Hearth will do with it."""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from app.device_probe import Probe, probe_devices
from app.hardware import cpu_model, gpu_memory, usable_cores
from app.llama_tools import BACKEND_ENV, BUILD_SCRIPT, LlamaToolsNotFound, llama_lib_env, vulkan_lib_dir
from app.residency.budget import detect_budget
from app.telemetry.drm import DrmSampler, list_cards

MIB = 1024 * 1024


def _mib(n: float) -> str:
    return f"{n / MIB:,.0f} MiB"


def advice(probe: Probe, nvidia: list, drm_cards: list) -> list[str]:
    """What to change for the box's GPU to be used, or what Hearth will do as it is."""
    notes = []
    gpus = probe.gpus
    if probe.error:
        notes.append(f"the device probe failed: {probe.error}")
    if nvidia:
        notes.append("NVIDIA GPU(s) through NVML: the budget is their VRAM; a model's layers go there with "
                     "`hearth models set NAME --gpu-layers 99` (llama-cpp-python built with CUDA)")
    elif gpus:
        names = ", ".join(f"{d.name} ({d.description})" for d in gpus)
        notes.append(f"layers offload to {names}: a model whose GPU layers are unset is fitted to the free memory "
                     "(context, KV type, layers; the Models page says why), or set them with "
                     "`hearth models set NAME --gpu-layers N`; the budget is that device memory")
        if any(not d.reports_usage for d in gpus):
            notes.append("the driver reports no memory use: Hearth counts the device buffers its runners report "
                         "(llama.cpp's own sizes)")
        if any("llvmpipe" in d.description.lower() for d in gpus):
            notes.append("this is Mesa's lavapipe, the CPU pretending to be a GPU: right for tests, slow for use; "
                         "flash attention is off there unless a model's runner asks -fa on (it crashed on one such box)")
    elif probe.backend == "vulkan":
        notes.append("the Vulkan build sees no GPU: ggml skips CPU-type Vulkan devices (Mesa's lavapipe) unless "
                     "GGML_VK_VISIBLE_DEVICES names them (e.g. GGML_VK_VISIBLE_DEVICES=0); in a container, pass "
                     "/dev/dri and the render group (compose.vulkan.yaml)")
    elif drm_cards:
        kinds = ", ".join(sorted({c.driver for c in drm_cards}))
        built = "" if vulkan_lib_dir() else f"build the Vulkan variant ({BUILD_SCRIPT} --vulkan), then "
        notes.append(f"an Intel/AMD GPU ({kinds}) is here but runners use the CPU build: {built}start serve with "
                     f"{BACKEND_ENV}=vulkan")
    else:
        notes.append("no GPU: models run on the CPU and the budget is RAM, as always")
    return notes


def examine(environ: dict[str, str] | None = None, nvml: Any = None, sys_root: Path = Path("/sys"),
            proc_root: Path = Path("/proc")) -> dict:
    """Everything the doctor says, as data (the Status page shows the same)."""
    env = dict(os.environ if environ is None else environ)
    probe = probe_devices(env)
    nvidia, nvml_note = gpu_memory(nvml)
    cards = list_cards(sys_root)
    drm = DrmSampler(sys_root, proc_root).sample(time.time())
    budget = detect_budget(nvml=nvml, devices=probe.devices if probe.backend != "cpu" else ())
    return {
        "cpu": {"model": cpu_model(), "cores": usable_cores()},
        "build": {"backend": probe.backend, "lib_path": _lib_path(probe, env), "visible": probe.env},
        "devices": [asdict(d) for d in probe.devices],
        "probe_error": probe.error,
        "nvml": {"gpus": [asdict(g) for g in nvidia], "note": nvml_note},
        "drm": {"cards": [{"card": f"card{c.index}", "driver": c.driver, "pdev": c.pdev} for c in cards],
                "readings": [{"source": s, "metric": m, "value": v} for s, m, v in drm]},
        "budget": {"kind": budget.kind, "total_bytes": budget.total_bytes, "usable_bytes": budget.usable_bytes,
                   "devices": list(budget.devices), "detail": budget.detail},
        "advice": advice(probe, nvidia, cards),
    }


def _lib_path(probe: Probe, env: dict[str, str]) -> str:
    if probe.backend == "cpu":
        return env.get("LLAMA_CPP_LIB_PATH") or "llama-cpp-python's own libraries (CPU)"
    try:
        return llama_lib_env(env)["LLAMA_CPP_LIB_PATH"]
    except LlamaToolsNotFound:
        return "(not built)"


def render(report: dict) -> str:
    """The report as the doctor command prints it."""
    lines = [f"CPU: {report['cpu']['model']}, {report['cpu']['cores']} cores usable",
             f"llama.cpp build: {report['build']['backend']} ({report['build']['lib_path']})"]
    for key, value in report["build"]["visible"].items():
        lines.append(f"  {key}={value}")
    lines.append("Devices llama.cpp sees:")
    for d in report["devices"]:
        usage = "" if d["reports_usage"] or d["kind"] == "cpu" else " (use not reported by the driver)"
        lines.append(f"  {d['name']:<10} {d['backend']:<7} {d['kind']:<5} {d['description']}: "
                     f"{_mib(d['free_bytes'])} free of {_mib(d['total_bytes'])}{usage}")
    if report["probe_error"]:
        lines.append(f"  (none read: {report['probe_error']})")
    lines.append(f"NVML: {report['nvml']['note']}")
    for g in report["nvml"]["gpus"]:
        lines.append(f"  {g['name']}: {_mib(g['free_bytes'])} free of {_mib(g['total_bytes'])}")
    cards = report["drm"]["cards"]
    lines.append("DRM (kernel): " + (", ".join(f"{c['card']} {c['driver']} at {c['pdev']}" for c in cards)
                                      if cards else "no amdgpu, i915 or xe card"))
    for r in report["drm"]["readings"]:
        value = _mib(r["value"]) if r["metric"].endswith("_bytes") else f"{r['value']:.0f} %"
        lines.append(f"  {r['source']} {r['metric']}: {value}")
    b = report["budget"]
    lines.append(f"Memory budget: {b['kind'].upper()}, {_mib(b['usable_bytes'])} usable of {_mib(b['total_bytes'])}"
                 f" ({b['detail'] or ', '.join(b['devices'])})")
    lines.append("What Hearth will do:")
    lines += [f"  - {note}" for note in report["advice"]]
    return "\n".join(lines)
