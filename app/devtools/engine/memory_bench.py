"""`hearth bench memory`: resident memory of a real `hearth runner` under concurrent load, against its target.

Target (issue: engine): runner RSS ≤ model file + KV cache + 150 MB, where the runner is the
gunicorn worker that holds the model (the arbiter is reported beside it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
import psutil

from app.devtools.processes import stop_process
from app.residency.supervisor import free_port

ALLOWANCE_BYTES = 150 * 1024 * 1024
MIB = 1024 * 1024


def _worker(proc: psutil.Process) -> psutil.Process:
    """The gunicorn worker (the child that loaded the model), or the process itself."""
    children = proc.children(recursive=True)
    return max(children, key=lambda p: p.memory_info().rss) if children else proc


def run_from_args(args, model_path: str) -> int:
    """Start a runner, load it with concurrent requests, sample RSS, print the figures."""
    port = free_port()
    cmd = [sys.executable, "-m", "app.cli", "runner", "--model", model_path, "--port", str(port),
           "--ctx", str(args.ctx), "--parallel", str(args.parallel), "--batch", str(args.batch),
           "--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    peak = {"worker": 0, "arbiter": 0}
    try:
        with httpx.Client(base_url=url, timeout=600) as c:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    print(proc.stderr.read().decode(errors="replace"), file=sys.stderr)
                    return 1
                try:
                    if c.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("runner did not become ready")
                time.sleep(0.2)
            props = c.get("/props").json()
        parent = psutil.Process(proc.pid)
        worker = _worker(parent)
        idle_rss = worker.memory_info().rss
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                peak["worker"] = max(peak["worker"], worker.memory_info().rss)
                peak["arbiter"] = max(peak["arbiter"], parent.memory_info().rss)
                time.sleep(0.05)

        def ask(i: int):
            with httpx.Client(base_url=url, timeout=600) as c:
                c.post("/v1/completions", json={"prompt": f"Request {i}: tell a long story. " * 20,
                                                "max_tokens": args.tokens, "ignore_eos": True})

        sampler = threading.Thread(target=sample)
        sampler.start()
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(args.requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        sampler.join()
    finally:
        stop_process(proc)
    model_bytes = os.path.getsize(model_path)
    kv_bytes = props["kv_cache_bytes"]
    target = model_bytes + kv_bytes + ALLOWANCE_BYTES
    print(f"runner: ctx {args.ctx}, parallel {args.parallel}, batch {args.batch}, threads {args.threads}; "
          f"{args.requests} concurrent requests × {args.tokens} tokens")
    print(f"worker RSS idle {idle_rss / MIB:.0f} MiB, peak under load {peak['worker'] / MIB:.0f} MiB "
          f"(arbiter peak {peak['arbiter'] / MIB:.0f} MiB)")
    print(f"target: model {model_bytes / MIB:.0f} + KV {kv_bytes / MIB:.0f} + 150 = {target / MIB:.0f} MiB → "
          f"{'within' if peak['worker'] <= target else 'OVER'} by {abs(target - peak['worker']) / MIB:.0f} MiB")
    return 0
