"""`hearth bench kv-types`: what a KV cache type costs, in bytes and in accuracy, on one model.

For each type (K and V alike) the model is loaded through the engine's own LlamaModel (the runner's -ctk/-ctv path):
the KV bytes the estimate gives (app.residency.estimate), and the bytes llama.cpp allocated (its "KV buffer size"
log lines, summed over the buffers: both caches of a sliding-window model); then a fixed text is decoded in one
batch with a logit row at every position, and each type's next-token distributions are compared with f16's: the
mean KL divergence KL(f16 ‖ type) over the positions, and the share of positions whose most likely token is f16's.
With --llama-server, a hearth runner and stock llama-server, both given the same -ctk/-ctv, answer one raw greedy
/completion each, and their tokens are compared.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np

from app.devtools.processes import stop_process, wait_healthy
from app.devtools.stock_server import stock_command
from app.engine.kv_types import KV_TYPES
from app.engine.model_config import ModelConfig
from app.residency.catalog import scan
from app.residency.estimate import MIB, estimate_memory
from app.residency.supervisor import free_port

# A fixed English text of household prose (about 200 tokens with Gemma's vocabulary): every position's next-token
# distribution is compared.
TEXT = (
    "The heating in the old house comes on at six in the morning, an hour before anyone gets up, so that the "
    "kitchen is warm when the kettle goes on. In winter the boiler struggles with the back bedroom, which faces "
    "north and loses its heat through a single-glazed window that nobody has got round to replacing. On Saturdays "
    "the children make pancakes, badly, and the smoke alarm in the hall goes off at least once; the dog waits "
    "under the table for whatever falls. The shopping list lives on the fridge door, held by a magnet shaped like "
    "a lemon, and it grows all week: milk, bread, washing-up liquid, batteries for the remote, something for "
    "Gran's birthday. By Sunday evening the list is half crossed out, the recycling is by the door, and the house "
    "settles into the quiet of a week about to begin."
)
_KV_BUFFER = re.compile(r"KV buffer size\s*=\s*([\d.]+) MiB")


@dataclass
class KvArm:
    """One KV cache type's figures."""

    type_k: str
    type_v: str
    estimate_bytes: int
    engine_bytes: int  # LlamaModel.kv_cache_bytes (what /props reports)
    measured_bytes: int  # llama.cpp's KV buffer lines, summed
    mean_kl: float = 0.0
    top1_agree: float = 1.0
    greedy_tokens: list[int] = field(default_factory=list)


def _capture_log() -> list[str]:
    """Routes llama.cpp's log into a list (kept referenced: llama.cpp holds the raw pointer)."""
    import llama_cpp

    lines: list[str] = []

    def on_log(_level: int, text: bytes, _user) -> None:
        lines.append(text.decode("utf-8", "replace"))

    cb = llama_cpp.llama_log_callback(on_log)
    llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))
    _capture_log.keep = cb  # type: ignore[attr-defined]
    return lines


def _all_logprobs(model, tokens: list[int]) -> np.ndarray:
    """Log-probabilities of the next token at every position of one decode of `tokens` (rows × vocabulary)."""
    # One chunk whose every token but the first is a "draft" token: the batch asks a logit row for each.
    chunk = SimpleNamespace(tokens=tokens, start_pos=0, request=SimpleNamespace(slot=0), num_draft=len(tokens) - 1,
                            want_logits=True)
    rc, _ = model.decode([chunk])
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")
    rows = np.stack([model.logits(i).astype(np.float64) for i in range(len(tokens))])
    rows -= rows.max(axis=1, keepdims=True)
    return rows - np.log(np.exp(rows).sum(axis=1, keepdims=True))


def measure(model_path: str, types: list[str], n_ctx: int, threads: int, n_tokens: int) -> list[KvArm]:
    """Every type's KV bytes (estimate, engine, llama.cpp's buffers) and its KL divergence against f16."""
    from app.engine.llama_model import LlamaModel

    log = _capture_log()
    entry = scan(None, Path(model_path))[0]
    arms: list[KvArm] = []
    reference: np.ndarray | None = None
    for t in ["f16", *[t for t in types if t != "f16"]]:
        start = len(log)
        config = ModelConfig(path=model_path, n_ctx=n_ctx, n_seq_max=1, n_batch=max(512, n_tokens),
                             n_threads=threads, n_outputs_extra=n_tokens, type_k=t, type_v=t, verbose=True)
        model = LlamaModel(config)
        try:
            tokens = model.tokenize(TEXT)[:n_tokens]
            measured = sum(float(m.group(1)) for line in log[start:] for m in [_KV_BUFFER.search(line)] if m)
            est = estimate_memory(entry, n_ctx, 1, type_k=t, type_v=t).kv_bytes
            arm = KvArm(t, t, est, model.kv_cache_bytes(), round(measured * MIB))
            logprobs = _all_logprobs(model, tokens)
        finally:
            model.close()
        arm.greedy_tokens = [int(x) for x in logprobs.argmax(axis=1)]
        if reference is None:
            reference = logprobs
        else:
            p = np.exp(reference)
            arm.mean_kl = float((p * (reference - logprobs)).sum(axis=1).mean())
            arm.top1_agree = float((reference.argmax(axis=1) == logprobs.argmax(axis=1)).mean())
        arms.append(arm)
        del logprobs
    return arms


def _completion_tokens(url: str, prompt: str, n_predict: int) -> list[int]:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "cache_prompt": False, "ignore_eos": True,
            "return_tokens": True}
    r = httpx.post(f"{url}/completion", json=body, timeout=600)
    r.raise_for_status()
    return list(r.json().get("tokens") or [])


def _serve_tokens(command: list[str], prompt: str, n_predict: int) -> list[int]:
    port = free_port()
    proc = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, lambda: None if proc.poll() is None else f"code {proc.returncode}", 180, command[0],
                     interval_s=0.2)
        return _completion_tokens(url, prompt, n_predict)
    finally:
        stop_process(proc)


def greedy_against_stock(model_path: str, llama_server: str, kv_type: str, threads: int, n_ctx: int,
                         n_predict: int) -> tuple[list[int], list[int]]:
    """(hearth runner's tokens, stock llama-server's) for one raw greedy /completion, both with -ctk/-ctv kv_type."""
    common = ["-m", model_path, "-c", str(n_ctx), "-np", "1", "-t", str(threads), "-ctk", kv_type, "-ctv", kv_type]
    prompt = TEXT[:400]
    hearth = _serve_tokens([sys.executable, "-m", "app.cli", "runner", *common], prompt, n_predict)
    # Hearth's cache layout (one unified cache, full-size sliding-window layers); --fit off: the stock server keeps
    # the given context instead of sizing its own (it is on by default).
    stock = _serve_tokens(stock_command(llama_server, None, *common, "--no-webui", "--fit", "off"), prompt, n_predict)
    return hearth, stock


def report(arms: list[KvArm]) -> str:
    """The table: bytes by source and their ratio to f16, and the accuracy cost."""
    f16 = arms[0]
    lines = [f"{'K/V':<14} {'estimate MiB':>12} {'engine MiB':>11} {'llama.cpp MiB':>14} {'/ f16':>6} "
             f"{'est/meas':>8} {'mean KL':>9} {'top-1 = f16':>11}"]
    for a in arms:
        lines.append(f"{a.type_k + '/' + a.type_v:<14} {a.estimate_bytes / MIB:>12.2f} {a.engine_bytes / MIB:>11.2f} "
                     f"{a.measured_bytes / MIB:>14.2f} {a.measured_bytes / f16.measured_bytes:>6.3f} "
                     f"{a.estimate_bytes / a.measured_bytes:>8.3f} {a.mean_kl:>9.5f} {a.top1_agree:>10.1%}")
    return "\n".join(lines)


def run_from_args(args, model_path: str) -> int:
    """Entry point of `hearth bench kv-types`."""
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    bad = [t for t in types if t not in KV_TYPES]
    if bad:
        raise SystemExit(f"hearth bench kv-types: unknown type(s) {bad}; choose from {', '.join(KV_TYPES)}")
    arms = measure(model_path, types, args.ctx, args.threads, args.tokens)
    print(f"{Path(model_path).name}: KV cache of {args.ctx} cells, 1 slot; KL(f16 ‖ type) of the next-token "
          f"distribution over {args.tokens} positions of a fixed text")
    print(report(arms))
    result = {"arms": [asdict(a) for a in arms]}
    if args.llama_server:
        if not Path(args.llama_server).is_file():
            raise SystemExit(f"hearth bench kv-types: no llama-server at {args.llama_server} "
                             "(scripts/build_llama_tools.sh builds it)")
        for t in types:
            hearth, stock = greedy_against_stock(model_path, args.llama_server, t, args.threads, args.ctx,
                                                 args.max_tokens)
            same = hearth == stock
            first = next((i for i, (a, b) in enumerate(zip(hearth, stock)) if a != b), None)
            print(f"greedy -ctk {t} -ctv {t}, raw /completion, {args.max_tokens} tokens: hearth runner and stock "
                  f"llama-server {'agree on every token' if same else f'part at token {first}'}")
            result[f"greedy_{t}"] = {"hearth": hearth, "stock": stock, "same": same}
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    return 0
