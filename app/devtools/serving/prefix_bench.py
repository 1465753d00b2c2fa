"""Multi-turn satellites through `hearth serve` (default settings) and stock llama-server, in one run.

    python -m app.devtools.serving.prefix_bench --llama-server ~/.cache/hearth/llama-tools/<v>/bin/llama-server \
        [--model GGUF] [--repeats 3] [--json out.json]

Two voice satellites share a ~2,000-token system prompt (instructions and a device list) and differ
in one area line; each asks three questions in turn with its history growing (A1, B1, A2, B2, A3, B3).
Every repetition starts from a new system prompt (a different first line), so its first turn is
cold on both servers. TTFT is the first streamed content token, as the client sees it. llama-server
runs with Hearth's slots (-np), context, threads and unified KV (-kvu), and its default prompt cache.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from app.devtools.processes import stop_process
from app.devtools.serve_process import ServeProcess, prepare_data
from app.devtools.stock_server import stock_command
from app.hardware import machine
from app.paths import sha256_of
from app.protocols import sse
from app.residency.budget import detect_budget
from app.residency.catalog import scan
from app.residency.estimate import size_runner
from app.residency.supervisor import free_port
from app.store.settings import REGISTRY
from app.telemetry.stats import median

QUESTIONS = ("Is the light on?", "Turn it off, please.", "And what is the temperature here?")
AREAS = ("kitchen", "garage")


def system_prompt(variant: int) -> str:
    """About 2,000 tokens of Home-Assistant-like instructions and devices, different per variant."""
    devices = "".join(
        f"- {area} {kind} {i}: entity_id {kind}.{area}_{i}, state {'on' if (i + variant) % 3 else 'off'}, "
        f"brightness {10 * (i % 10)} %, last changed {i % 24:02d}:{(7 * i) % 60:02d}\n"
        for i, (area, kind) in enumerate(
            [(a, k) for a in ("kitchen", "hall", "bedroom", "garage", "office", "bathroom")
             for k in ("light", "lamp", "plug", "fan", "sensor")] * 2
        )
    )
    return (f"Session {variant}. You are the voice assistant of a family home. Answer in one short sentence. "
            "Use the devices below; never invent one.\n" + devices)


def ttft_stream(client: httpx.Client, url: str, headers: dict, messages: list[dict]) -> tuple[float, str, int | None]:
    """Stream one chat completion: (ms to the first content token, the text, cached tokens if reported)."""
    body = {"messages": messages, "max_tokens": 24, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    first = None
    text = ""
    cached = None
    # A new connection per request, for both servers: this llama-server drops a kept-alive one
    # between requests ("Server disconnected without sending a response").
    with client.stream("POST", url, json=body, headers={**headers, "Connection": "close"}) as r:
        r.raise_for_status()
        for ev in sse.payloads(r.iter_bytes()):
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if first is None:
                        first = time.monotonic()
                    text += piece
            usage = ev.get("usage") or {}
            if usage.get("prompt_tokens_details"):
                cached = usage["prompt_tokens_details"].get("cached_tokens")
            if ev.get("timings", {}).get("cache_n") is not None and cached is None:
                cached = ev["timings"]["cache_n"]
    return ((first or time.monotonic()) - t0) * 1000, text, cached


def conversation(client: httpx.Client, url: str, headers: dict, variant: int) -> list[dict]:
    """A1, B1, A2, B2, A3, B3 for one system prompt; one row per turn."""
    system = system_prompt(variant)
    history = {a: [{"role": "system", "content": f"{system}This satellite is in the {a}."}] for a in AREAS}
    rows = []
    for turn, question in enumerate(QUESTIONS, 1):
        for area in AREAS:
            history[area].append({"role": "user", "content": question})
            ms, text, cached = ttft_stream(client, url, headers, history[area])
            history[area].append({"role": "assistant", "content": text})
            rows.append({"variant": variant, "turn": turn, "area": area, "ttft_ms": ms, "cached_tokens": cached})
    return rows


def start_llama_server(binary: str, model: str, ctx: int, parallel: int, threads: int,
                       log_path: Path) -> tuple[subprocess.Popen, str]:
    """Stock llama-server on loopback with Hearth's slots, context and threads, unified KV."""
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(stock_command(binary, model, "-c", str(ctx), "-np", str(parallel), "-t", str(threads),
                                              "-kvu", "--no-webui", port=port, same_cache=False),
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise TimeoutError("llama-server did not become healthy")


def summarise(rows: list[dict]) -> dict:
    """TTFT p50 of cold first turns, of the second satellite's first turns and of later turns."""
    first = [r["ttft_ms"] for r in rows if r["turn"] == 1 and r["area"] == AREAS[0]]
    second = [r["ttft_ms"] for r in rows if r["turn"] == 1 and r["area"] == AREAS[1]]
    later = [r["ttft_ms"] for r in rows if r["turn"] > 1]
    return {"first_turn_p50_ms": median(first), "second_satellite_first_turn_p50_ms": median(second),
            "later_turns_p50_ms": median(later), "later_over_first": median(later) / median(first)}


def main(argv: list[str] | None = None) -> int:
    """Run both servers, interleaved per repetition, and print the figures."""
    from app.residency.default_model import ensure_default_model

    p = argparse.ArgumentParser(prog="python -m app.devtools.serving.prefix_bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    p.add_argument("--llama-server", required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_path")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hearth-prefix-bench-"))
    model = Path(args.model) if args.model else ensure_default_model(work, progress=False)
    models = work / "models"
    models.mkdir(exist_ok=True)
    # The serve sizes its runner from the memory budget and the model (no stored default); llama-server gets the same.
    sized = size_runner(scan(None, model)[0], detect_budget().usable_bytes)
    ctx = REGISTRY["runner_ctx"].default or sized.n_ctx
    parallel = REGISTRY["runner_parallel"].default or sized.parallel
    data = work / "data"
    data.mkdir()
    # Default settings but threads (the reference box has 2 cores, the comparison holds them equal).
    tokens = prepare_data(data, settings={"runner_threads": args.threads}, tokens=[("satellite", "voice", [])])
    constants = {"model": str(model), "model_sha256": sha256_of(model), "n_ctx": ctx, "parallel": parallel,
                 "threads": args.threads, "llama_server": f"-np {parallel} -c {ctx} -t {args.threads} -kvu",
                 "questions": QUESTIONS, "areas": AREAS, "repeats": args.repeats, "machine": machine()}
    print("prefix bench — held constant:", json.dumps(constants), file=sys.stderr)
    serve = ServeProcess(data, models, model, work / "serve.log")
    llama, llama_url = start_llama_server(args.llama_server, str(model), ctx, parallel, args.threads,
                                          work / "llama-server.log")
    rows: dict[str, list[dict]] = {"hearth": [], "llama-server": []}
    try:
        with httpx.Client(timeout=600) as client:
            hearth_headers = {"Authorization": f"Bearer {tokens['satellite']}"}
            # Warm-up on both (model load, first-run page faults), with a prompt of its own.
            conversation(client, serve.url + "/v1/chat/completions", hearth_headers, -1)
            ttft_stream(client, llama_url + "/v1/chat/completions", {}, [{"role": "user", "content": "Hello"}])
            for rep in range(args.repeats):
                rows["hearth"] += conversation(client, serve.url + "/v1/chat/completions", hearth_headers, rep)
                rows["llama-server"] += conversation(client, llama_url + "/v1/chat/completions", {}, rep)
                print(f"  repetition {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    finally:
        serve.stop()
        stop_process(llama)
    summary = {k: summarise(v) for k, v in rows.items()}
    summary["hearth_later_over_llama_later"] = (summary["hearth"]["later_turns_p50_ms"]
                                                / summary["llama-server"]["later_turns_p50_ms"])
    for k in ("hearth", "llama-server"):
        s = summary[k]
        print(f"{k:>13}: first turn p50 {s['first_turn_p50_ms']:.0f} ms, second satellite's first turn "
              f"{s['second_satellite_first_turn_p50_ms']:.0f} ms, later turns p50 {s['later_turns_p50_ms']:.0f} ms "
              f"({s['later_over_first']:.3f}× first)")
    print(f"later turns, hearth / llama-server: {summary['hearth_later_over_llama_later']:.3f}")
    for r in rows["hearth"]:
        print(f"  hearth v{r['variant']} turn {r['turn']} {r['area']}: {r['ttft_ms']:.0f} ms, "
              f"cached {r['cached_tokens']}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"constants": constants, "summary": summary, "rows": rows},
                                                   indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
