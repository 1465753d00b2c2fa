"""`hearth bench gateway` and `hearth bench residency`: what the control plane costs, measured in one run.

gateway    added latency of `hearth serve` over calling its runner directly (alternating A/B):
           non-streamed p50, streamed TTFT p50, and 8 concurrent streams' tok/s ratio.
residency  load/unload cycles of one model: serve's RSS growth, runners left behind, events recorded.
"""

from __future__ import annotations

import json
import re
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from app.devtools.serve_process import ServeProcess, prepare_data

MIB = 1024 * 1024


def _completion(client: httpx.Client, url: str, headers: dict, max_tokens: int) -> float:
    t0 = time.perf_counter()
    r = client.post(url, json={"prompt": "Hello", "max_tokens": max_tokens, "temperature": 0}, headers=headers)
    r.raise_for_status()
    return (time.perf_counter() - t0) * 1000


# A streamed event that carries a generated token (not the role chunk a runner sends first).
TOKEN_EVENT = re.compile(rb'"(content|text|reasoning_content)": "[^"]|"tool_calls": \[')


def first_token_ms(client: httpx.Client, url: str, headers: dict) -> float:
    """Client stopwatch to the first generated token of a streamed 4-token completion."""
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", url, headers=headers, json={"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                                          "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and TOKEN_EVENT.search(line.encode()):
                first = (time.perf_counter() - t0) * 1000
    return first


def added_latency_samples(client: httpx.Client, serve: ServeProcess, gw_headers: dict,
                          samples: int) -> tuple[dict, dict]:
    """Alternating direct/gateway samples of a 1-token answer and of the first streamed token (ms each)."""
    gw = serve.url + "/v1/completions"
    _completion(client, gw, gw_headers, 1)  # loads the model
    direct, direct_headers = serve.runner_url() + "/v1/completions", serve.runner_headers()
    for _ in range(3):  # warm both paths
        _completion(client, gw, gw_headers, 1)
        _completion(client, direct, direct_headers, 1)
    lat = {"direct": [], "gateway": []}
    ttft = {"direct": [], "gateway": []}
    for _ in range(samples):
        lat["direct"].append(_completion(client, direct, direct_headers, 1))
        lat["gateway"].append(_completion(client, gw, gw_headers, 1))
        ttft["direct"].append(first_token_ms(client, direct, direct_headers))
        ttft["gateway"].append(first_token_ms(client, gw, gw_headers))
    return lat, ttft


def _streams(url: str, headers: dict, n: int, tokens: int) -> float:
    """Generated tok/s of n concurrent streams."""
    counts = [0] * n
    last: list[str] = [""] * n

    def one(i: int):
        with httpx.Client(timeout=600) as c:
            with c.stream("POST", url, headers=headers, json={"prompt": f"Story {i}:", "max_tokens": tokens,
                                                             "ignore_eos": True, "stream": True}) as r:
                last[i] = f"HTTP {r.status_code}"
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"text": ""' not in line:
                        counts[i] += 1
                    elif line.strip():
                        last[i] = f"HTTP {r.status_code}, last line {line[:300]!r}"

    wall_s = run_together(one, n)
    if 0 in counts:
        # A stream that generated nothing would make the rate (and the ratio against it) meaningless.
        i = counts.index(0)
        raise SystemExit(f"hearth bench gateway: stream {i} to {url} got no tokens ({last[i]})")
    return sum(counts) / wall_s


def run_together(one, n: int) -> float:
    """Run one(0) … one(n-1) on n threads at once; the wall seconds until the last one ends."""
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def run_gateway(args, model_path: str) -> int:
    """Measure the gateway's added latency and streaming throughput against its own runner."""
    with tempfile.TemporaryDirectory(prefix="hearth-bench-") as tmp:
        data = Path(tmp) / "data"
        models = Path(tmp) / "models"
        models.mkdir()
        # One token stands for every client here: it may hold the whole class (member_class_share 1).
        tokens = prepare_data(data, settings={"runner_ctx": args.ctx, "runner_parallel": args.parallel,
                                              "runner_threads": args.threads, "member_class_share": 1.0},
                              classes={"chat": {"max_concurrent": 64, "max_queue": 64}},
                              tokens=[("bench", "chat", [])])
        serve = ServeProcess(data, models, Path(model_path), Path(tmp) / "serve.log")
        try:
            gw_headers = {"Authorization": f"Bearer {tokens['bench']}"}
            client = httpx.Client(timeout=600)
            lat, ttft = added_latency_samples(client, serve, gw_headers, args.samples)
            gw, direct = serve.url + "/v1/completions", serve.runner_url() + "/v1/completions"
            rates = {"direct": [], "gateway": []}
            for _ in range(args.repeats):
                rates["direct"].append(_streams(direct, serve.runner_headers(), args.streams, args.tokens))
                rates["gateway"].append(_streams(gw, gw_headers, args.streams, args.tokens))
            client.close()
        finally:
            serve.stop()
    med = {k: statistics.median(v) for k, v in lat.items()}
    med_t = {k: statistics.median(v) for k, v in ttft.items()}
    med_r = {k: statistics.median(v) for k, v in rates.items()}
    ratios = [g / d for g, d in zip(rates["gateway"], rates["direct"])]
    print(f"model {model_path}; runner ctx {args.ctx}, parallel {args.parallel}, threads {args.threads}; "
          f"{args.samples} alternating samples, {args.repeats} stream repetitions")
    print(f"non-streamed (1 token): direct p50 {med['direct']:.2f} ms, gateway p50 {med['gateway']:.2f} ms "
          f"→ added {med['gateway'] - med['direct']:.2f} ms")
    print(f"streamed TTFT:          direct p50 {med_t['direct']:.2f} ms, gateway p50 {med_t['gateway']:.2f} ms "
          f"→ added {med_t['gateway'] - med_t['direct']:.2f} ms")
    print(f"{args.streams} concurrent streams × {args.tokens} tokens: direct {med_r['direct']:.1f} tok/s, "
          f"gateway {med_r['gateway']:.1f} tok/s → ratio {statistics.median(ratios):.3f} "
          f"(per repetition {', '.join(f'{r:.3f}' for r in ratios)})")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"latency_ms": lat, "ttft_ms": ttft, "stream_tok_s": rates,
                                                    "ratios": ratios}, indent=1))
    return 0


def run_residency(args, model_path: str) -> int:
    """Load and unload the model `cycles` times through serve; report RSS growth, leftovers and events."""
    with tempfile.TemporaryDirectory(prefix="hearth-bench-") as tmp:
        data = Path(tmp) / "data"
        models = Path(tmp) / "models"
        models.mkdir()
        name = Path(model_path).stem
        tokens = prepare_data(data, settings={"runner_ctx": args.ctx, "runner_parallel": args.parallel,
                                              "runner_threads": args.threads},
                              tokens=[("bench", "chat", [])], policies={name: "on_demand"})
        serve = ServeProcess(data, models, Path(model_path), Path(tmp) / "serve.log")
        rss = []
        leftovers = []
        try:
            headers = {"Authorization": f"Bearer {tokens['bench']}"}
            for i in range(args.cycles):
                r = serve.client.post("/v1/completions", headers=headers, json={"prompt": "Hi", "max_tokens": 2})
                r.raise_for_status()
                # on_demand: the runner stops when the last lease is released; give it a moment.
                deadline = time.monotonic() + 30
                while serve.runner_processes() and time.monotonic() < deadline:
                    time.sleep(0.05)
                leftovers.append(len(serve.runner_processes()))
                rss.append(serve.serve_rss_bytes())
                print(f"  cycle {i + 1}/{args.cycles}: serve RSS {rss[-1] / MIB:.1f} MiB, runners left {leftovers[-1]}",
                      file=sys.stderr, flush=True)
        finally:
            serve.stop()
        time.sleep(0.2)
        with sqlite3.connect(data / "hearth.db") as db:
            events = db.execute("select event, cold_start_ms from residency_events where model_name = ?",
                                (name,)).fetchall()
    loads = [ms for ev, ms in events if ev == "load"]
    unloads = [ev for ev, _ in events if ev == "unload"]
    print(f"{args.cycles} load/unload cycles of {name}: serve RSS after cycle 1 {rss[0] / MIB:.1f} MiB, "
          f"after cycle {args.cycles} {rss[-1] / MIB:.1f} MiB → growth {(rss[-1] - rss[0]) / MIB:.1f} MiB")
    print(f"runners left after each unload: max {max(leftovers)}; events: {len(loads)} loads, {len(unloads)} unloads; "
          f"cold start p50 {statistics.median(loads):.0f} ms (min {min(loads):.0f}, max {max(loads):.0f})")
    return 0
