"""`hearth bench vram`: the residency estimate of a model against what the GPU (NVML) says it uses, and the NVML sampler under load.

One `hearth runner` is started with the model fully offloaded; NVML's used memory before the
start and after the model is loaded (and again after a burst of requests) is compared with
app/residency/estimate.py's figure for the same context and slots. Meanwhile the telemetry's
own GPU sampler (app/telemetry/sampler.sample_gpus) is read every SAMPLE_EVERY_S, so its
readings under load are checked too. Without an NVIDIA GPU (a CPU dry-run) the runner's RSS
stands in for the measured footprint and the sampler is recorded as empty.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from app.devtools.processes import stop_process
from app.hardware import gpu_memory, machine, nvml_gpus
from app.residency.catalog import scan
from app.residency.estimate import estimate_memory
from app.residency.supervisor import free_port
from app.telemetry.sampler import sample_gpus

SAMPLE_EVERY_S = 0.25
LOAD_TOKENS = 64
# The target: the estimate within ±10 % of NVML's measurement.
TOLERANCE = 0.10


def _used_bytes() -> list[int]:
    gpus, _note = gpu_memory()
    return [g.total_bytes - g.free_bytes for g in gpus]


def _process_gpu_bytes(pids: set[int]) -> int | None:
    """Bytes NVML counts for these processes on every GPU (None: NVML cannot tell)."""
    found = nvml_gpus()
    if found is None:
        return None
    nvml, handles = found
    total = 0
    try:
        for h in handles:
            for p in nvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid in pids and p.usedGpuMemory is not None:
                    total += int(p.usedGpuMemory)
    except Exception:  # NVMLError: some drivers refuse process queries in containers
        return None
    return total


def _tree(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _rss(procs: list[psutil.Process]) -> int:
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the runner exited with {proc.returncode} while loading")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the runner was not healthy within {timeout_s} s")


def _load(url: str, requests: int) -> list[dict]:
    """`requests` completions at once, fixed length; returns their usage."""
    results: list[dict] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        body = {"prompt": f"Request {i}: tell the household what the server is doing.", "max_tokens": LOAD_TOKENS,
                "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=600.0)
        with lock:
            results.append({"status": r.status_code, "usage": r.json().get("usage") if r.status_code == 200 else None})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def run_vram(model: str, ctx: int, parallel: int, gpu_layers: int, threads: int, requests: int,
             load_timeout_s: float = 300.0) -> dict:
    """Start a runner, compare the estimate with the measured footprint, sample NVML under load."""
    entry = scan(None, Path(model))[0]
    est = estimate_memory(entry, ctx, parallel)
    before = _used_bytes()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "app.cli", "runner", "--model", model, "--ctx", str(ctx), "--parallel", str(parallel),
           "--gpu-layers", str(gpu_layers), "--threads", str(threads), "--port", str(port)]
    proc = subprocess.Popen(cmd)
    samples: list[dict] = []
    stop = threading.Event()

    def sampler() -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            samples.append({"t_s": time.monotonic() - t0, "readings": sample_gpus()})
            stop.wait(SAMPLE_EVERY_S)

    try:
        load_s = _wait_healthy(url, proc, load_timeout_s)
        ps = psutil.Process(proc.pid)
        loaded = _used_bytes()
        pids = {p.pid for p in _tree(ps)}
        proc_loaded = _process_gpu_bytes(pids)
        rss_loaded = _rss(_tree(ps))
        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        t0 = time.monotonic()
        results = _load(url, requests)
        load_wall_s = time.monotonic() - t0
        stop.set()
        th.join()
        after = _used_bytes()
        proc_after = _process_gpu_bytes(pids)
        rss_after = _rss(_tree(ps))
    finally:
        stop.set()
        stop_process(proc)
    gpu = bool(before)
    measured = None
    if gpu:
        # Device-wide delta, so CUDA context, cuBLAS workspaces and the compute buffer all count.
        measured = max(sum(after) - sum(before), sum(loaded) - sum(before))
    else:
        measured = max(rss_loaded, rss_after)
    ratio = est.total_bytes / measured if measured else None
    utils = [v for s in samples for (_src, metric, v) in s["readings"] if metric == "gpu_util_pct"]
    return {
        "model": model, "ctx": ctx, "parallel": parallel, "gpu_layers": gpu_layers, "threads": threads,
        "measured_on": "NVML device used memory (delta over the runner's start)" if gpu else "runner RSS (no GPU)",
        "estimate": {"weights_bytes": est.weights_bytes, "kv_bytes": est.kv_bytes, "compute_bytes": est.compute_bytes,
                     "overhead_bytes": est.overhead_bytes, "total_bytes": est.total_bytes},
        "nvml_used_before_bytes": before, "nvml_used_loaded_bytes": loaded, "nvml_used_after_load_bytes": after,
        "nvml_process_bytes_loaded": proc_loaded, "nvml_process_bytes_after_load": proc_after,
        "rss_loaded_bytes": rss_loaded, "rss_after_load_bytes": rss_after,
        "measured_bytes": measured, "estimate_over_measured": ratio,
        "within_tolerance": None if ratio is None else abs(ratio - 1) <= TOLERANCE,
        "load_s": load_s, "load_requests": requests, "load_wall_s": load_wall_s,
        "load_ok": sum(r["status"] == 200 for r in results),
        "sampler": {"every_s": SAMPLE_EVERY_S, "num_samples": len(samples),
                    "num_readings": sum(len(s["readings"]) for s in samples),
                    "gpu_util_pct_max": max(utils, default=None),
                    "gpu_util_pct_mean": sum(utils) / len(utils) if utils else None,
                    "samples": samples},
        "machine": machine(),
    }


def run_from_args(args, model_path: str) -> int:
    """`hearth bench vram`: print the comparison, write JSON when asked."""
    doc = run_vram(model_path, args.ctx, args.parallel, args.gpu_layers, args.threads, args.requests)
    mib = 2**20
    r = doc["estimate_over_measured"]
    print(f"estimate {doc['estimate']['total_bytes'] / mib:,.0f} MiB vs measured {doc['measured_bytes'] / mib:,.0f} MiB "
          f"({doc['measured_on']}): ratio {r:.3f}" if r else "no measurement")
    s = doc["sampler"]
    print(f"NVML sampler: {s['num_samples']} samples, {s['num_readings']} readings under {doc['load_requests']} "
          f"requests; GPU util max {s['gpu_util_pct_max']}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(doc, indent=1))
    return 0
