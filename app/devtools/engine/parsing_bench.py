"""`hearth bench parsing`: what splitting answers costs a streamed answer's per-token time (a lab figure).

Starts a `hearth runner` on the given model (the embedded one by default) with llama.cpp's Qwen3 chat
template, and drives it directly over loopback HTTP (no gateway): 8 concurrent streams, each forced by
a grammar to write a thought and then an answer, run in interleaved rounds (ABBA):
  parser   the runner's default: the answer parser splits the thought into reasoning_content and
           scans the rest for Hermes calls (a tool is offered)
  plain    reasoning_format "none" and no tools: no parser, the text goes out as it comes
Per-token time is each stream's client stopwatch: from its first text delta to its finishing chunk,
over its generated tokens less one; the median of the streams of every round of an arm. Every stream
runs to max_tokens (ignore_eos), so both arms keep 8 streams to the end. The target (issue 26): the
parser adds at most 5 % at 8 streams.

On a busy machine the end-to-end figure is noisy, so the parser's own cost is measured beside it:
the plain arm's streamed pieces (one per token, raw thought and answer text) pushed through the same
AnswerParser the runner uses, its time per token set against the plain per-token time.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from app.devtools.processes import stop_process
from app.hardware import machine
from app.protocols.sse import Decoder
from app.residency.supervisor import free_port
from app.telemetry.stats import median

STREAMS = 8
TEMPLATE = "Qwen-Qwen3-0.6B.jinja"
TARGET_RATIO = 1.05
# A thought, its end, then an answer that never completes: every stream runs to max_tokens, so both arms
# generate the same tokens' worth of text and differ only in what the runner does with it.
GRAMMAR = 'root ::= "<think>\\n" [a-z ,.]{1,400} "\\n</think>\\n\\n" [A-Za-z ,.]+'
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
QUESTIONS = ["Why is the sky blue?", "How do bees make honey?", "What makes bread rise?",
             "Why do cats purr?", "How does a fridge keep cold?", "Why do leaves change colour?",
             "How do tides work?", "What is a rainbow?"]


def template_path() -> Path:
    """llama.cpp's Qwen3 template, in the vendored tree scripts/build_llama_tools.sh unpacks."""
    path = (Path.home() / ".cache/hearth/llama-tools/0.3.36/src/llama_cpp_python-0.3.36/vendor/llama.cpp"
            / "models/templates" / TEMPLATE)
    if not path.is_file():
        sys.exit(f"hearth bench parsing needs llama.cpp's {TEMPLATE} at {path}: run scripts/build_llama_tools.sh")
    return path


def start_runner(model_path: str, threads: int, template: Path) -> tuple[subprocess.Popen, str]:
    """A hearth runner process on a free loopback port, once /health answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "runner", "--model", model_path, "--port", str(port),
                             "--ctx", str(STREAMS * 1024), "--parallel", str(STREAMS), "--threads", str(threads),
                             "--chat-template-file", str(template)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            sys.exit("the runner exited: " + proc.stderr.read().decode(errors="replace")[-2000:])
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            stop_process(proc)
            sys.exit("the runner did not become ready in 300 s")
        time.sleep(0.2)


def body(arm: str, question: str, max_tokens: int) -> dict:
    """One stream's request in an arm."""
    out = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
           "stream": True, "grammar": GRAMMAR, "ignore_eos": True}
    if arm == "plain":
        out["reasoning_format"] = "none"
    else:
        out["tools"] = [TOOL]
    return out


def one_stream(url: str, request: dict) -> dict:
    """Stream one answer; the client's times of its first text delta and of its finishing chunk."""
    first = last = None
    tokens = 0
    fields = {"reasoning_content": 0, "content": 0}
    pieces: list[str] = []
    decoder = Decoder()
    with httpx.Client(timeout=600) as client, client.stream("POST", url + "/v1/chat/completions",
                                                            json=request) as resp:
        resp.raise_for_status()
        for chunk in resp.iter_bytes():
            now = time.perf_counter()
            for ev in decoder.feed(chunk):
                if ev.done:
                    continue
                data = ev.json()
                for choice in data.get("choices") or []:
                    delta = choice.get("delta") or {}
                    for key in fields:
                        if delta.get(key):
                            fields[key] += len(delta[key])
                            first = first if first is not None else now
                            pieces.append(delta[key])
                    if choice.get("finish_reason"):
                        last = now
                        tokens = data["usage"]["completion_tokens"]
    per_token_ms = (last - first) * 1000 / (tokens - 1) if first is not None and last and tokens > 1 else None
    return {"tokens": tokens, "per_token_ms": per_token_ms, "chars": fields, "pieces": pieces}


def parser_cost_us(template: str, streams: list[dict]) -> float:
    """The answer parser's time per piece (µs) over raw streamed answers, as the runner parses the parser arm."""
    from app.engine.formats import AnswerParser, detect

    fmt = detect(template)
    total_s, count = 0.0, 0
    for _ in range(5):
        for stream in streams:
            parser = AnswerParser(fmt, [TOOL])
            t0 = time.perf_counter()
            for piece in stream["pieces"]:
                parser.push(piece)
            parser.finish()
            total_s += time.perf_counter() - t0
            count += len(stream["pieces"])
    return total_s * 1e6 / count if count else 0.0


def one_round(url: str, arm: str, max_tokens: int) -> list[dict]:
    """STREAMS streams of one arm at once."""
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        return list(pool.map(lambda q: one_stream(url, body(arm, q, max_tokens)), QUESTIONS[:STREAMS]))


def run_parsing_bench(model_path: str, threads: int, rounds: int, max_tokens: int, out: str | None) -> dict:
    """Interleaved rounds of both arms; prints both per-token times and their ratio, returns the JSON."""
    template = template_path()
    proc, url = start_runner(model_path, threads, template)
    try:
        props = httpx.get(url + "/props", timeout=30).json()
        header = {"bench": "parsing", "figure": "lab (hearth runner driven directly over loopback HTTP, no gateway)",
                  "model": model_path, "template": TEMPLATE, "chat_format": props.get("chat_format"),
                  "streams": STREAMS, "max_tokens": max_tokens, "rounds": rounds, "threads": threads,
                  "grammar": GRAMMAR, "machine": machine()}
        print(json.dumps(header))
        runs: dict[str, list[list[dict]]] = {"plain": [], "parser": []}
        for arm in runs:
            one_round(url, arm, 8)  # warm-up: the grammar compiled, both arms' prompts in the prefix cache
        for i in range(rounds):
            # ABBA: each arm goes first in every other round, so a drift in the machine's load hits both alike.
            for arm in (("plain", "parser") if i % 2 == 0 else ("parser", "plain")):
                runs[arm].append(one_round(url, arm, max_tokens))
    finally:
        stop_process(proc)
    per_token = {arm: median([s["per_token_ms"] for r in rs for s in r if s["per_token_ms"] is not None])
                 for arm, rs in runs.items()}
    ratio = per_token["parser"] / per_token["plain"] if per_token["plain"] else None
    split = runs["parser"][-1][0]["chars"]
    cost_us = parser_cost_us(template.read_text(), [s for r in runs["plain"] for s in r])
    share = cost_us / 1000 / per_token["plain"] if per_token["plain"] else None
    print(f"{STREAMS} streams x {max_tokens} tokens, {rounds} interleaved rounds (lab figure: runner driven directly)")
    print(f"  plain  (reasoning_format none, no tools): {per_token['plain']:.2f} ms per token")
    print(f"  parser (thought split, Hermes calls scanned): {per_token['parser']:.2f} ms per token")
    print(f"  ratio {ratio:.3f} (target <= {TARGET_RATIO}); one parsed stream: {split['reasoning_content']} chars "
          f"of reasoning_content, {split['content']} of content")
    print(f"  the parser's own cost: {cost_us:.1f} us per token, {share * 100:.4f} % of the plain per-token time "
          "(the plain streams' pieces replayed through AnswerParser)")
    result = {"header": header, "per_token_ms": per_token, "ratio": ratio, "target_ratio": TARGET_RATIO,
              "parser_us_per_token": cost_us, "parser_share": share, "runs": runs}
    if out:
        Path(out).write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    return result
