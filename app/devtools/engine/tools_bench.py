"""`hearth bench tools`: constrained decoding's cost and validity on the embedded model (a lab figure).

Runs the runner's own WSGI app in-process (templates, grammars, parsers, engine: everything but the
gateway hop), one model, held constant:
  throughput  8 concurrent streams of which 4 are json_schema-constrained vs the same 8 unconstrained,
              interleaved A/B repetitions in one run; total generated tok/s and the ratio;
  compile     the 20-tool Home-Assistant set's call grammar: JSON Schema → GBNF plus llama.cpp's parse,
              cold, then cached (what every later request pays);
  validity    N Home-Assistant-shaped requests with tool_choice "required": calls whose arguments
              validate against the chosen tool's schema; N AI-Task json_schema answers that validate.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time
from pathlib import Path

from app.devtools.ha_tools import (
    AI_TASK_PROMPTS,
    AI_TASK_SCHEMA,
    HA_TOOLS,
    ai_task_body,
    ha_chat_body,
    sample_commands,
)
from app.engine.model_config import ModelConfig
from app.hardware import machine
from app.paths import sha256_of
from app.telemetry.stats import median

THROUGHPUT_STREAMS = 8
THROUGHPUT_TOKENS = 64
PARTS = ("compile", "throughput", "validity")
# Long enough that no answer ends before THROUGHPUT_TOKENS: both runs then generate the same number
# of tokens and tok/s compares the decoding itself, not shorter constrained answers.
LONG_SCHEMA = {"type": "object", "properties": {"steps": {
    "type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 12, "maxItems": 12}},
    "required": ["steps"], "additionalProperties": False}
LONG_PROMPTS = ["List twelve steps to bake bread.", "List twelve things to pack for a camping trip.",
                "List twelve chores for a Saturday.", "List twelve ways to save energy at home."]


def _validator():
    try:
        import jsonschema_rs
    except ImportError:
        sys.exit("hearth bench tools validates answers with jsonschema_rs: pip install 'hearth[test]'")
    return jsonschema_rs


def _post(client, body: dict) -> dict:
    r = client.post("/v1/chat/completions", json=body)
    return {"status": r.status_code, "body": r.get_json()}


def _throughput(client, constrained: int, reps: int) -> dict:
    """Interleaved runs: all unconstrained, then `constrained` of 8 with a schema; tok/s of each."""
    runs: dict[str, list[dict]] = {"unconstrained": [], "mixed": []}
    for _ in range(reps):
        for kind in ("unconstrained", "mixed"):
            bodies = []
            for i in range(THROUGHPUT_STREAMS):
                body = {"messages": [{"role": "user", "content": LONG_PROMPTS[i % len(LONG_PROMPTS)]}],
                        "max_tokens": THROUGHPUT_TOKENS, "temperature": 0, "ignore_eos": kind == "unconstrained"
                        or i >= constrained}
                if kind == "mixed" and i < constrained:
                    body["response_format"] = {"type": "json_schema",
                                               "json_schema": {"name": "steps", "schema": LONG_SCHEMA}}
                bodies.append(body)
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(THROUGHPUT_STREAMS) as pool:
                answers = list(pool.map(lambda b: _post(client, b), bodies))
            wall = time.perf_counter() - t0
            tokens = sum(a["body"]["usage"]["completion_tokens"] for a in answers if a["status"] == 200)
            runs[kind].append({"wall_s": wall, "completion_tokens": tokens, "tok_s": tokens / wall,
                               "per_request": [a["body"].get("timings") for a in answers]})
    un = median([r["tok_s"] for r in runs["unconstrained"]])
    mixed = median([r["tok_s"] for r in runs["mixed"]])
    return {"runs": runs, "unconstrained_tok_s": un, "mixed_tok_s": mixed, "ratio": mixed / un if un else None}


def _compile(model) -> dict:
    """Cold and cached compile times of the HA call grammar (ms)."""
    from app.engine import grammar as g
    from app.engine.formats.detection import GENERIC
    from app.engine.formats.grammars import call_grammar

    cold, cached = [], []
    for _ in range(5):
        g._calls_gbnf.cache_clear()
        g._layout_gbnf.cache_clear()
        model._grammars.clear()
        t0 = time.perf_counter()
        spec = call_grammar(GENERIC, HA_TOOLS[:20], "required", True)
        sampler = model.grammar_sampler(spec)
        cold.append((time.perf_counter() - t0) * 1000)
        model.free_sampler(sampler)
        t0 = time.perf_counter()
        spec = call_grammar(GENERIC, HA_TOOLS[:20], "required", True)
        sampler = model.grammar_sampler(spec)
        cached.append((time.perf_counter() - t0) * 1000)
        model.free_sampler(sampler)
    return {"tools": 20, "gbnf_chars": len(spec.gbnf), "cold_ms": cold, "cached_ms": cached,
            "cold_ms_median": median(cold), "cached_ms_median": median(cached)}


def _validity(client, n: int, concurrency: int) -> dict:
    jsonschema_rs = _validator()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in HA_TOOLS}
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        calls = list(pool.map(lambda c: _post(client, ha_chat_body(c, "required", stream=False)),
                              sample_commands(n)))
        answers = list(pool.map(lambda i: _post(client, ai_task_body(AI_TASK_PROMPTS[i % len(AI_TASK_PROMPTS)]
                                                                     + f" (report {i})")), range(n)))
    call_ok, call_raw = 0, []
    for a in calls:
        msg = a["body"]["choices"][0]["message"] if a["status"] == 200 else {}
        tcs = msg.get("tool_calls") or []
        ok = bool(tcs) and all(jsonschema_rs.is_valid(schemas[t["function"]["name"]],
                                                      json.loads(t["function"]["arguments"])) for t in tcs)
        call_ok += ok
        call_raw.append({"ok": ok, "finish": a["body"]["choices"][0]["finish_reason"] if a["status"] == 200 else None,
                         "tool_calls": tcs, "content": msg.get("content"), "timings": a["body"].get("timings")})
    json_ok, json_raw = 0, []
    for a in answers:
        content = a["body"]["choices"][0]["message"]["content"] if a["status"] == 200 else None
        try:
            ok = content is not None and jsonschema_rs.is_valid(AI_TASK_SCHEMA, json.loads(content))
        except ValueError:
            ok = False
        json_ok += ok
        json_raw.append({"ok": ok, "content": content, "timings": a["body"].get("timings")})
    return {"requests": n, "tool_calls_valid": call_ok, "json_schema_valid": json_ok,
            "tool_calls": call_raw, "json_schema": json_raw}


def run_tools_bench(model_path: str, threads: int, requests: int, reps: int, out: str | None,
                    parts: tuple[str, ...] = PARTS) -> dict:
    """Run the three parts and print their figures; returns the JSON written to out."""
    from werkzeug.test import Client

    from app.runner.app import create_app
    from app.runner.config import RunnerConfig

    cfg = ModelConfig(path=model_path, n_ctx=8192, n_seq_max=THROUGHPUT_STREAMS, n_batch=512, n_threads=threads)
    app = create_app(RunnerConfig(cfg, default_max_tokens=256, max_waiting=256))
    while app.state.status == "loading":
        time.sleep(0.1)
    if app.state.status != "ok":
        sys.exit(f"model failed to load: {app.state.error}")
    client = Client(app)
    header = {"bench": "tools", "figure": "lab (runner app in-process, no gateway)", "model": model_path,
              "model_sha256": sha256_of(Path(model_path)), "n_ctx": cfg.n_ctx, "n_batch": cfg.n_batch,
              "n_seq_max": cfg.n_seq_max, "threads": threads, "n_gpu_layers": cfg.n_gpu_layers, "mode": "continuous",
              "tool_format": app.state.chat_format.name, "machine": machine()}
    print(json.dumps(header))
    compile_ = tp = val = None
    try:
        if "compile" in parts:
            compile_ = _compile(app.state.model)
            print(f"grammar compile, 20 HA tools: cold {compile_['cold_ms_median']:.1f} ms, cached "
                  f"{compile_['cached_ms_median']:.2f} ms (median of 5; {compile_['gbnf_chars']} GBNF chars)")
        if "throughput" in parts:
            tp = _throughput(client, THROUGHPUT_STREAMS // 2, reps)
            tokens = {k: [r["completion_tokens"] for r in v] for k, v in tp["runs"].items()}
            print(f"8 streams x {THROUGHPUT_TOKENS} tokens: unconstrained {tp['unconstrained_tok_s']:.1f} tok/s, "
                  f"4 of 8 json_schema {tp['mixed_tok_s']:.1f} tok/s, ratio {tp['ratio']:.2f} "
                  f"(median of {reps}, interleaved; tokens per run {tokens})")
        if "validity" in parts:
            val = _validity(client, requests, concurrency=4)
            print(f"tool_choice required, HA-shaped: {val['tool_calls_valid']}/{requests} calls validate; "
                  f"json_schema: {val['json_schema_valid']}/{requests} answers validate")
    finally:
        app.state.engine.stop()
    result = {"header": header, "compile": compile_, "throughput": tp, "validity": val}
    if out:
        Path(out).write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    return result
