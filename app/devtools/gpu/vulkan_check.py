"""`hearth bench vulkan`: the offload path run for real on a Vulkan device (Mesa's lavapipe in CI, an Intel/AMD GPU at
home), against llama.cpp's own accounting and stock llama-server's Vulkan build of the same tree.

1. A load with every layer offloaded, in a child process with ggml's memory logger on (GGML_VK_MEMORY_LOGGER): the
   layers llama.cpp put on the GPU ("offloaded N/N layers"), its device buffers per part (model, KV, compute) from
   its own log lines, the cold start's split (read, upload to the device, context), then the model freed and
   ggml-vulkan's running total of device allocations read again: 0 B means no device buffer was left.
2. The residency estimate's device part (weights + KV + compute, app.residency.estimate) against those buffers.
3. The oracle: `hearth runner -ngl 99` and stock llama-server (`-ngl 99 -fa off`) of the Vulkan build, same model,
   context and prompts, greedy: the generated token ids of each prompt compared.
Speed is never measured here: lavapipe is the CPU pretending to be a GPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from app.devtools.processes import stop_process
from app.devtools.stock_server import stock_command
from app.hardware import machine
from app.llama_tools import BACKEND_ENV, LlamaToolsNotFound, llama_lib_env, vulkan_llama_server
from app.residency.catalog import scan
from app.residency.estimate import estimate_memory

PROMPTS = ("The capital of France is", "Once upon a time, in a small house by the sea,",
           "def fibonacci(n):", "List three colours:", "The household server answers")
TOLERANCE = 0.10
_TOTAL = re.compile(r"Total device: ([0-9.]+) (B|KiB|MiB|GiB)")
_UNIT = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
LOADED = "hearth-vulkan-check: loaded"


def vulkan_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a Vulkan runner gets here: the Vulkan build's libraries, and lavapipe made visible (ggml
    skips CPU-type devices) unless GGML_VK_VISIBLE_DEVICES is already set."""
    env = dict(os.environ if environ is None else environ)
    env[BACKEND_ENV] = "vulkan"
    env.update(llama_lib_env(env))
    env.setdefault("GGML_VK_VISIBLE_DEVICES", "0")
    return env


def _device_total(stderr: str) -> list[int]:
    return [round(float(n) * _UNIT[u]) for n, u in _TOTAL.findall(stderr)]


def load_and_free(model: str, ctx: int, parallel: int, env: dict[str, str], timeout_s: float = 600) -> dict:
    """Step 1 in a child process: what a full offload allocates on the device, and what is left after freeing."""
    child_env = {**env, "GGML_VK_MEMORY_LOGGER": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, "-m", "app.devtools.gpu.vulkan_check", "--load-and-free", model, str(ctx),
                           str(parallel)], env=child_env, capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the load child exited {done.returncode}: {done.stderr[-2000:]}")
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    before_close, _, closing = done.stderr.partition(LOADED)
    loaded = _device_total(before_close)
    left = _device_total(closing)
    facts["logger_device_peak_bytes"] = max(loaded, default=None)
    facts["logger_device_loaded_bytes"] = loaded[-1] if loaded else None
    facts["logger_device_left_bytes"] = left[-1] if left else (0 if loaded else None)
    return facts


def _child_load_and_free(model: str, ctx: int, parallel: int) -> int:
    from app.engine.llama_model import LlamaModel
    from app.engine.model_config import ModelConfig

    config = ModelConfig(path=model, n_ctx=ctx, n_seq_max=parallel, n_batch=512, n_threads=os.cpu_count() or 2,
                         n_gpu_layers=99)
    m = LlamaModel(config)
    facts = m.describe()
    facts["load_timings"] = m.load_timings
    # ggml-vulkan's logger writes to the same stderr, unbuffered: what follows the marker is the freeing.
    sys.stderr.write(f"\n{LOADED}\n")
    sys.stderr.flush()
    m.close()
    print(json.dumps(facts))
    return 0


def _start(command: list[str], env: dict[str, str], log: Path, timeout_s: float = 600) -> tuple[subprocess.Popen, str]:
    from app.residency.supervisor import free_port

    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([*command, "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{command[0]} exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200 and r.json().get("status") == "ok":
                return proc, url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{command[0]} was not ready within {timeout_s} s")


TOP_N = 5


def greedy_tokens(url: str, prompts: tuple[str, ...], n_predict: int) -> tuple[list[list[int]], list[list[list]]]:
    """Each prompt's generated token ids, greedy, through /completion (return_tokens, llama-server's), and at each
    step the TOP_N likeliest ids with their log-probabilities (n_probs): a random model's greedy text often repeats
    one token, the ranking beneath it still tells two backends' arithmetic apart."""
    tokens, tops = [], []
    for prompt in prompts:
        r = httpx.post(url + "/completion", json={"prompt": prompt, "n_predict": n_predict, "temperature": 0,
                                                  "return_tokens": True, "cache_prompt": False, "n_probs": TOP_N},
                       timeout=900)
        r.raise_for_status()
        body = r.json()
        tokens.append(list(body["tokens"]))
        tops.append([[(c["id"], c["logprob"]) for c in step["top_logprobs"]]
                     for step in body.get("completion_probabilities") or []])
    return tokens, tops


def oracle(model: str, ctx: int, env: dict[str, str], prompts: tuple[str, ...], n_predict: int,
           workdir: Path) -> dict:
    """Step 3: Hearth's runner and stock llama-server, both on the Vulkan device, same greedy prompts."""
    # The llama-server of the very build the runner loads: beside its libraries where that folder holds one (the
    # Vulkan image's /opt/hearth/llama-lib), else the cached Vulkan build's.
    lib_dir = env.get("LLAMA_CPP_LIB_PATH")
    beside = Path(lib_dir) / "llama-server" if lib_dir else None
    server = beside if beside is not None and beside.is_file() else vulkan_llama_server()
    if server is None:
        raise LlamaToolsNotFound("stock llama-server of the Vulkan build is not built: scripts/build_llama_tools.sh --vulkan")
    threads = str(min(os.cpu_count() or 2, 4))
    hearth_cmd = [sys.executable, "-m", "app.cli", "runner", "--model", model, "--ctx", str(ctx), "--parallel", "1",
                  "--gpu-layers", "99", "--threads", threads]
    # The context as Hearth's runner makes it (app.engine.llama_model): unified KV, full-size sliding-window caches,
    # n_batch 512. With llama-server's defaults instead (a smaller SWA cache) Gemma 3's log-probabilities differed
    # by up to 0.064 from the first token on, on the same device; with these by 3e-4 at most.
    stock_cmd = stock_command(server, model, "-c", str(ctx), "-np", "1", "-ngl", "99", "-fa", "off", "-t", threads,
                              "--no-webui", env=env)
    answers, tops = {}, {}
    for name, cmd in (("hearth", hearth_cmd), ("llama-server", stock_cmd)):
        proc, url = _start(cmd, env, workdir / f"{name}.log")
        try:
            answers[name], tops[name] = greedy_tokens(url, prompts, n_predict)
            props = httpx.get(url + "/props", timeout=30).json() if name == "hearth" else None
        finally:
            stop_process(proc)
        if props is not None:
            answers["hearth_props_model"] = props.get("model")
    same = [a == b for a, b in zip(answers["hearth"], answers["llama-server"])]
    ranked = [[[i for i, _ in step] for step in steps] for steps in tops["hearth"]]
    same_top = [a == [[i for i, _ in step] for step in b] for a, b in zip(ranked, tops["llama-server"])]
    gaps = [abs(x[1] - y[1]) for a, b in zip(tops["hearth"], tops["llama-server"]) for sa, sb in zip(a, b)
            for x, y in zip(sa, sb)]
    return {"prompts": list(prompts), "n_predict": n_predict, "hearth_tokens": answers["hearth"],
            "llama_server_tokens": answers["llama-server"], "same": same, "num_same": sum(same),
            "top_n": TOP_N, "same_top_n": same_top, "num_same_top_n": sum(same_top),
            "num_ranked_steps": sum(len(s) for s in ranked), "max_logprob_gap": max(gaps, default=None),
            "hearth_top": tops["hearth"], "llama_server_top": tops["llama-server"],
            "hearth_model_facts": answers.get("hearth_props_model")}


def tiny_model(workdir: Path) -> str:
    """The tiny random-weight model (`hearth models random tiny`): decode is cheap even on lavapipe."""
    from app.devtools.gguf_shapes import SHAPES, make_model

    path = workdir / "tiny.gguf"
    make_model(SHAPES["tiny"], path)
    return str(path)


def run_check(model: str | None, ctx: int, parallel: int, n_predict: int, prompts: tuple[str, ...] = PROMPTS) -> dict:
    """All three steps; the figures as one document."""
    env = vulkan_env()
    with tempfile.TemporaryDirectory(prefix="hearth-vulkan-") as tmp:
        workdir = Path(tmp)
        model = model or tiny_model(workdir)
        facts = load_and_free(model, ctx, parallel, env)
        vulkan = {k: v for k, v in (facts.get("buffers") or {}).items() if k.startswith("Vulkan") and "_" not in k}
        device_bytes = sum(sum(parts.values()) for parts in vulkan.values())
        entry = scan(None, Path(model))[0]
        est = estimate_memory(entry, ctx, parallel, flash_attn=facts.get("flash_attn") != "off")
        est_device = est.weights_bytes + est.kv_bytes + est.compute_bytes
        parity = oracle(model, ctx, env, prompts, n_predict, workdir)
    ratio = est_device / device_bytes if device_bytes else None
    return {
        "model": model, "ctx": ctx, "parallel": parallel, "env": {k: env[k] for k in (
            "LLAMA_CPP_LIB_PATH", "GGML_VK_VISIBLE_DEVICES") if k in env},
        "devices": facts.get("devices"), "flash_attn": facts.get("flash_attn"),
        "offloaded_layers": facts.get("offloaded_layers"), "buffers": facts.get("buffers"),
        "device_buffer_bytes": device_bytes, "load_timings": facts.get("load_timings"),
        "logger_device_loaded_bytes": facts.get("logger_device_loaded_bytes"),
        "logger_device_left_bytes": facts.get("logger_device_left_bytes"),
        "estimate_device_bytes": est_device, "estimate": {"weights_bytes": est.weights_bytes, "kv_bytes": est.kv_bytes,
                                                          "compute_bytes": est.compute_bytes},
        "estimate_over_buffers": ratio, "within_tolerance": None if ratio is None else abs(ratio - 1) <= TOLERANCE,
        "parity": parity, "machine": machine(),
    }


def run_from_args(args) -> int:
    """`hearth bench vulkan`: print the figures, write JSON when asked; exit 1 when a target is missed."""
    try:
        doc = run_check(args.model, args.ctx, args.parallel, args.n_predict)
    except LlamaToolsNotFound as exc:
        print(f"hearth bench vulkan: {exc}", file=sys.stderr)
        return 2
    mib = 1 << 20
    layers = doc["offloaded_layers"]
    t = doc["load_timings"] or {}
    print(f"devices: {', '.join(d['name'] + ' (' + d['description'] + ')' for d in doc['devices'] or [])}")
    print(f"offloaded layers: {layers[0]}/{layers[1]}" if layers else "offloaded layers: not reported")
    print(f"flash attention: {doc['flash_attn']}")
    for name, parts in (doc["buffers"] or {}).items():
        print(f"  {name}: " + ", ".join(f"{part} {size / mib:.2f} MiB" for part, size in parts.items()))
    print(f"device buffers {doc['device_buffer_bytes'] / mib:.2f} MiB; estimate's device part "
          f"{doc['estimate_device_bytes'] / mib:.2f} MiB; ratio {doc['estimate_over_buffers']:.3f}")
    print(f"ggml-vulkan's device total: loaded {doc['logger_device_loaded_bytes']} B, "
          f"after freeing {doc['logger_device_left_bytes']} B")
    print(f"cold start: read {t.get('read_ms', 0):.0f} ms, upload {t.get('upload_ms') or 0:.1f} ms, "
          f"context {t.get('context_ms', 0):.0f} ms")
    p = doc["parity"]
    print(f"greedy tokens equal to stock llama-server (Vulkan): {p['num_same']} of {len(p['same'])} prompts "
          f"({p['n_predict']} tokens each); top-{p['top_n']} ids equal at every step: {p['num_same_top_n']} of "
          f"{len(p['same_top_n'])} prompts ({p['num_ranked_steps']} steps), largest log-probability gap "
          f"{p['max_logprob_gap']:.2g}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(doc, indent=1))
    ok = (layers and layers[0] == layers[1] and doc["within_tolerance"] and doc["logger_device_left_bytes"] == 0
          and p["num_same"] == len(p["same"]) and p["num_same_top_n"] == len(p["same_top_n"]))
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--load-and-free":
        raise SystemExit(_child_load_and_free(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    raise SystemExit("usage: python -m app.devtools.gpu.vulkan_check --load-and-free MODEL CTX PARALLEL")
