"""`hearth bench engine`: the engine in-process (no HTTP), modes × overlap levels, optional C++ reference.

Three workloads, one model, held constant:
  mixed     L overlapping requests of mixed prompt and output lengths, arriving --stagger-ms apart, per mode;
  uniform   L identical requests (16-token prompts, 64 generated) in continuous mode, to compare the
            pure batched-decode rate with llama.cpp's own llama-batched-bench on the same settings;
  pressure  8 long requests into a KV cache too small to hold them together: preemption must keep
            every request whole;
  shared    (--shared-prefix N) 8 requests sharing an N-token prefix, distinct 48-token suffixes,
            arriving together, prefix cache on and off alternating: prompt tokens computed, TTFT p95;
            plus the mixed workload (no shared prefixes) on and off: generated tok/s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from app.engine.engine import Engine
from app.engine.model_config import ModelConfig
from app.engine.request import Finished, RequestStats, SamplingParams
from app.hardware import machine
from app.paths import sha256_of
from app.policy import MODES
from app.telemetry.stats import median, quantile
from app.verdict.texts import corpus

# Mixed workload: prompt and output lengths cycle through these (tokens), so level L takes the first L.
MIXED_PROMPT_TOKENS = (24, 200, 48, 320, 16, 120, 64, 260)
MIXED_OUTPUT_TOKENS = (16, 96, 32, 128, 24, 64, 48, 112)
UNIFORM_PROMPT_TOKENS = 16
UNIFORM_GEN_TOKENS = 64
PRESSURE_REQUESTS = 8
PRESSURE_PROMPT_TOKENS = 100
PRESSURE_GEN_TOKENS = 200
RSS_ALLOWANCE_BYTES = 150 * 1024 * 1024
SHARED_REQUESTS = 8
SHARED_SUFFIX_TOKENS = 48
SHARED_GEN_TOKENS = 32


@dataclass
class RunResult:
    """One workload run: raw per-request stats and iterations, plus the summary derived from them."""

    workload: str
    mode: str
    level: int
    wall_s: float
    requests: list[dict]
    iterations: list[dict]
    summary: dict = field(default_factory=dict)

    def summarise(self) -> None:
        """Derive the summary from the raw data (so anyone can recompute it from the JSON)."""
        reqs = [r for r in self.requests]
        gen = sum(r["num_completion_tokens"] for r in reqs)
        prompt = sum(r["num_prompt_tokens"] for r in reqs)
        its = self.iterations
        iter_ms = sum(i["iteration_ms"] for i in its)
        decode_ms = sum(i["decode_ms"] for i in its)
        pure = [i for i in its if i["num_prompt_tokens"] == 0 and i["num_decode_tokens"] > 0]
        decode_tok_s = None
        if pure:
            span_s = pure[-1]["start_s"] + pure[-1]["iteration_ms"] / 1000 - pure[0]["start_s"]
            decode_tok_s = sum(i["num_decode_tokens"] for i in pure) / span_s if span_s > 0 else None
        pure_iter_ms = sum(i["iteration_ms"] for i in pure)
        self.summary = {
            "generated_tokens": gen,
            "prompt_tokens": prompt,
            "gen_tok_s": gen / self.wall_s if self.wall_s else None,
            "prompt_tok_s": prompt / self.wall_s if self.wall_s else None,
            "decode_tok_s": decode_tok_s,
            "ttft_p50_ms": quantile([r["ttft_ms"] for r in reqs if r["ttft_ms"] is not None], 0.5),
            "ttft_p95_ms": quantile([r["ttft_ms"] for r in reqs if r["ttft_ms"] is not None], 0.95),
            "completion_p50_ms": quantile([r["total_ms"] for r in reqs], 0.5),
            "completion_p95_ms": quantile([r["total_ms"] for r in reqs], 0.95),
            "kv_peak_util": max((i["kv_used"] / i["kv_total"] for i in its), default=0.0),
            "kv_mean_util": statistics.fmean(i["kv_used"] / i["kv_total"] for i in its) if its else 0.0,
            "preemptions": sum(i["num_preemptions"] for i in its),
            "outside_decode_share": (iter_ms - decode_ms) / iter_ms if iter_ms else None,
            "outside_decode_share_decode_phase": (
                (pure_iter_ms - sum(i["decode_ms"] for i in pure)) / pure_iter_ms if pure_iter_ms else None
            ),
            "iterations": len(its),
            "finish_reasons": sorted({r["finish_reason"] for r in reqs}),
        }


def _cut(tokens: list[int], n: int, offset: int) -> list[int]:
    """n tokens of real text starting at a per-request offset (different prompts, same statistics)."""
    start = (offset * 37) % max(1, len(tokens) - n)
    return tokens[start : start + n]


def run_workload(model, mode: str, specs: list[tuple[list[int], int]], token_budget: int | None,
                 workload: str, stagger_s: float = 0.0, timeout_s: float = 1800, prefix_cache: bool = True) -> RunResult:
    """Submit the requests to a fresh engine on the model (request i at i × stagger_s) and wait for all."""
    engine = Engine(model, mode=mode, token_budget=token_budget, max_waiting=max(64, len(specs)),
                    prefix_cache=prefix_cache).start()
    # The bench waits for completions without reading each token as it comes: a consumer thread
    # woken per token would compete with llama.cpp's threads for the cores, and that cost belongs
    # to the client (measured by the HTTP benchmarks), not to the engine.
    done = threading.Semaphore(0)
    engine.finished_listeners.append(lambda stats: done.release())
    try:
        t0 = time.monotonic()
        handles = []
        for i, (prompt, n_out) in enumerate(specs):
            arrival_s = t0 + i * stagger_s
            time.sleep(max(0.0, arrival_s - time.monotonic()))
            handles.append(
                engine.submit(prompt, SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True),
                              class_name=workload, arrival_s=arrival_s)
            )
        for _ in handles:
            if not done.acquire(timeout=max(0.0, t0 + timeout_s - time.monotonic())):
                raise RuntimeError(f"requests did not finish within {timeout_s} s (lost?)")
        finished_s = time.monotonic()
        results: list[RequestStats] = []
        for h in handles:
            for ev in engine.events(h):
                if isinstance(ev, Finished):
                    if ev.error:
                        raise RuntimeError(f"request {h.request_id} failed: {ev.error}")
                    results.append(ev.stats)
        wall_s = finished_s - t0
        # Anything left in a queue after its Finished event would be a duplicated answer.
        extra_events = sum(h.events.qsize() for h in handles)
        iterations = [dict(asdict(i), start_s=i.start_s - t0) for i in engine.iterations if i.start_s >= t0]
    finally:
        engine.stop()
    run = RunResult(workload, mode, len(specs), wall_s, [r.as_dict() for r in results], iterations)
    run.summarise()
    run.summary["events_after_finish"] = extra_events
    return run


def mixed_specs(tokens: list[int], level: int) -> list[tuple[list[int], int]]:
    """The first `level` requests of the mixed workload."""
    n = len(MIXED_PROMPT_TOKENS)
    return [(_cut(tokens, MIXED_PROMPT_TOKENS[i % n], i), MIXED_OUTPUT_TOKENS[i % n]) for i in range(level)]


def uniform_specs(tokens: list[int], level: int) -> list[tuple[list[int], int]]:
    """`level` requests shaped like llama-batched-bench's (-npp 16 -ntg 64)."""
    return [(_cut(tokens, UNIFORM_PROMPT_TOKENS, i), UNIFORM_GEN_TOKENS) for i in range(level)]


def shared_specs(tokens: list[int], prefix_tokens: int) -> list[tuple[list[int], int]]:
    """SHARED_REQUESTS prompts: one prefix of real text, then a suffix of their own."""
    prefix = tokens[:prefix_tokens]
    return [(prefix + _cut(tokens[prefix_tokens:], SHARED_SUFFIX_TOKENS, i + 1), SHARED_GEN_TOKENS)
            for i in range(SHARED_REQUESTS)]


def run_shared(model, args, tokens: list[int]) -> dict:
    """Shared-prefix and no-shared-prefix workloads, cache on and off alternating per repetition."""
    specs = shared_specs(tokens, args.shared_prefix)
    ideal = args.shared_prefix + SHARED_REQUESTS * SHARED_SUFFIX_TOKENS
    reps: dict[str, list[dict]] = {"on": [], "off": []}
    mixed: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(args.repeats):
        for state in ("on", "off"):
            run = run_workload(model, "continuous", specs, args.budget, "shared", prefix_cache=state == "on")
            computed = sum(i["num_prompt_tokens"] for i in run.iterations)
            ttfts = [r["ttft_ms"] for r in run.requests]
            reps[state].append({"prompt_tokens_computed": computed, "ttft_p95_ms": quantile(ttfts, 0.95),
                                "ttft_p50_ms": median(ttfts),
                                "cached_tokens": sum(r["num_cached_tokens"] for r in run.requests),
                                "requests": run.requests})
            m = run_workload(model, "continuous", mixed_specs(tokens, SHARED_REQUESTS), args.budget, "mixed",
                             prefix_cache=state == "on")
            mixed[state].append(m.summary["gen_tok_s"])
    ttft_ratios = [a["ttft_p95_ms"] / b["ttft_p95_ms"] for a, b in zip(reps["on"], reps["off"])]
    gen_ratios = [a / b for a, b in zip(mixed["on"], mixed["off"])]
    summary = {
        "prefix_tokens": args.shared_prefix, "ideal_prompt_tokens": ideal,
        "computed_on": median([r["prompt_tokens_computed"] for r in reps["on"]]),
        "computed_off": median([r["prompt_tokens_computed"] for r in reps["off"]]),
        "ttft_p95_on_ms": median([r["ttft_p95_ms"] for r in reps["on"]]),
        "ttft_p95_off_ms": median([r["ttft_p95_ms"] for r in reps["off"]]),
        "ttft_p95_ratio": median(ttft_ratios), "ttft_p95_ratios": ttft_ratios,
        "mixed_gen_tok_s_on": median(mixed["on"]), "mixed_gen_tok_s_off": median(mixed["off"]),
        "mixed_gen_ratio": median(gen_ratios), "mixed_gen_ratios": gen_ratios,
    }
    summary["computed_over_ideal"] = summary["computed_on"] / ideal
    return {"summary": summary, "runs": reps, "mixed_gen_tok_s": mixed}


def _fmt(v, spec=".1f", none="-") -> str:
    return none if v is None else format(v, spec)


def print_table(runs: list[RunResult], out=sys.stdout) -> None:
    """The per mode × level table."""
    head = (f"{'workload':<9}{'mode':<11}{'L':>3}{'gen tok/s':>10}{'dec tok/s':>10}{'TTFT p50':>10}{'TTFT p95':>10}"
            f"{'done p50':>10}{'done p95':>10}{'KV peak':>8}{'preempt':>8}{'outside':>8}")
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in runs:
        s = r.summary
        print(
            f"{r.workload:<9}{r.mode:<11}{r.level:>3}{_fmt(s['gen_tok_s']):>10}{_fmt(s['decode_tok_s']):>10}"
            f"{_fmt(s['ttft_p50_ms'], '.0f')+'ms':>10}{_fmt(s['ttft_p95_ms'], '.0f')+'ms':>10}"
            f"{_fmt(s['completion_p50_ms'], '.0f')+'ms':>10}{_fmt(s['completion_p95_ms'], '.0f')+'ms':>10}"
            f"{s['kv_peak_util']*100:>7.0f}%{s['preemptions']:>8}"
            f"{_fmt(None if s['outside_decode_share'] is None else s['outside_decode_share']*100, '.1f')+'%':>8}",
            file=out,
        )


def median_run(runs: list[RunResult]) -> RunResult:
    """The repetition whose generated tok/s is the median (raw data of one real run, not a blend)."""
    ordered = sorted(runs, key=lambda r: r.summary["gen_tok_s"] or 0.0)
    return ordered[len(ordered) // 2]


def run_from_args(args, model_cfg: ModelConfig) -> int:
    """Run the whole benchmark as `hearth bench engine` asked, print tables, write JSON."""
    from app.engine.llama_model import LlamaModel

    levels = args.levels
    cfg = dataclasses.replace(model_cfg, n_seq_max=max(max(levels), args.parallel))
    proc = psutil.Process()
    rss_before_load = proc.memory_info().rss
    model = LlamaModel(cfg)
    constants = _constants(args, model, cfg)
    print("hearth bench engine — held constant:", file=sys.stderr)
    for k, v in constants.items():
        print(f"  {k}: {v}", file=sys.stderr)
    tokens = model.tokenize(corpus(), add_special=False)
    runs, all_runs, uniform_reps, reference_reps = _measure(model, args, cfg, tokens)
    rss_after = proc.memory_info().rss
    kv_bytes = model.kv_cache_bytes()
    model.close()
    reference = reference_reps or None

    shared = None
    if getattr(args, "shared_prefix", 0):
        model = LlamaModel(cfg)
        try:
            shared = run_shared(model, args, tokens)
        finally:
            model.close()
    pressure = None
    if args.pressure_ctx:
        pressure = run_pressure(cfg, args.pressure_ctx, tokens_source=corpus())

    print_table(runs)
    summary = {"ratios": {}}
    if reference:
        _print_ratios(summary, levels, uniform_reps, reference)
    _print_top_level(summary, runs, levels)
    _print_memory(summary, constants, kv_bytes, rss_before_load, rss_after)
    if shared:
        _print_shared(summary, shared)
    if pressure:
        _print_pressure(summary, pressure)
    if args.json_path:
        doc = {"constants": constants, "summary": summary, "reference": reference, "pressure": pressure,
               "shared": shared,
               "runs": [asdict(r) for r in runs], "all_repetitions": [asdict(r) for r in all_runs]}
        Path(args.json_path).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json_path}", file=sys.stderr)
    return 0


def _constants(args, model, cfg: ModelConfig) -> dict:
    """What the benchmark holds constant, printed first and written into the JSON."""
    model_path = cfg.path
    info = model.describe()
    return {
        "model": model_path,
        "model_sha256": sha256_of(model_path),
        "model_desc": info["desc"],
        "model_file_bytes": os.path.getsize(model_path),
        "n_ctx": model.n_ctx,
        "n_batch": model.n_batch,
        "n_ubatch": min(model.n_batch, 512),
        "n_seq_max": model.n_seq_max,
        "threads": cfg.n_threads,
        "gpu_layers": cfg.n_gpu_layers,
        "repack": cfg.repack_enabled,
        "token_budget": args.budget or model.n_batch,
        "kv_unified": True,
        "sampling": "greedy, ignore_eos (fixed output lengths)",
        "levels": args.levels,
        "mixed_arrivals": f"request i arrives at i × {args.stagger_ms} ms",
        "mixed_prompt_tokens": MIXED_PROMPT_TOKENS,
        "mixed_output_tokens": MIXED_OUTPUT_TOKENS,
        "uniform": f"{UNIFORM_PROMPT_TOKENS}-token prompts, {UNIFORM_GEN_TOKENS} generated, all at once",
        "modes": args.modes,
        "repeats": args.repeats,
        "machine": machine(),
    }


def _measure(model, args, cfg: ModelConfig, tokens: list[int]):
    """The mixed runs per level and mode, then the uniform runs alternating with the C++ reference.

    Returns the runs shown (medians), every repetition, the uniform repetitions per level and the reference's."""
    levels = args.levels
    model_path = cfg.path
    runs: list[RunResult] = []
    all_runs: list[RunResult] = []

    def measure(workload: str, mode: str, level: int, specs, stagger_s: float = 0.0) -> RunResult:
        reps = [run_workload(model, mode, specs, args.budget, workload, stagger_s) for _ in range(args.repeats)]
        all_runs.extend(reps)
        best = median_run(reps)
        print(f"  {workload} {mode} L={level}: {best.summary['gen_tok_s']:.1f} gen tok/s", file=sys.stderr, flush=True)
        return best

    # Warm-up, discarded: the first run in a process pays for cold caches and page faults.
    run_workload(model, "continuous", uniform_specs(tokens, 1), args.budget, "warmup")
    # Interleave modes inside each level, so drift on a shared machine hits all modes alike.
    for level in levels:
        for mode in args.modes:
            runs.append(measure("mixed", mode, level, mixed_specs(tokens, level), args.stagger_ms / 1000))
    # Uniform runs and the C++ reference alternate per repetition (A, B, A, B, ...): a ratio is
    # taken within one repetition, then the median over repetitions is reported with its spread.
    binary = None
    if args.reference:
        from app.devtools.reference import find_batched_bench, run_batched_bench

        binary = find_batched_bench(args.reference)
    uniform_reps: dict[int, list[RunResult]] = {level: [] for level in levels}
    reference_reps: list[dict[int, dict]] = []
    for _ in range(args.repeats):
        for level in levels:
            uniform_reps[level].append(
                run_workload(model, "continuous", uniform_specs(tokens, level), args.budget, "uniform")
            )
        if binary is not None:
            rows = run_batched_bench(
                binary, model_path, model.n_ctx, model.n_batch, cfg.n_threads, levels,
                UNIFORM_PROMPT_TOKENS, UNIFORM_GEN_TOKENS, timeout_s=1800,
                gpu_layers=cfg.n_gpu_layers, repack=cfg.repack_enabled,
            )
            reference_reps.append({r.n_parallel: asdict(r) for r in rows})
    for reps in uniform_reps.values():
        all_runs.extend(reps)
    uniform = {level: median_run(reps) for level, reps in uniform_reps.items()}
    runs.extend(uniform.values())
    return runs, all_runs, uniform_reps, reference_reps


def _print_ratios(summary: dict, levels: list[int], uniform_reps: dict[int, list[RunResult]],
                  reference: list[dict[int, dict]]) -> None:
    """Decode tok/s of the engine against llama-batched-bench per level, ratios into summary."""
    print("\ndecode tok/s, engine vs llama-batched-bench (same model, ctx, batch, threads, unified KV), "
          f"alternating, median of {len(reference)}:")
    print(f"{'L':>3}{'engine':>10}{'reference':>11}{'ratio':>8}{'ratio range':>15}{'outside':>9}")
    for lvl in levels:
        pairs = [
            (u.summary["decode_tok_s"], ref[lvl]["decode_tokens_per_s"])
            for u, ref in zip(uniform_reps[lvl], reference)
            if u.summary["decode_tok_s"] and ref[lvl]["decode_tokens_per_s"]
        ]
        ratios = [ours / theirs for ours, theirs in pairs]
        ratio = median(ratios)
        summary["ratios"][str(lvl)] = {"median": ratio, "all": ratios}
        outside = median([u.summary["outside_decode_share_decode_phase"] for u in uniform_reps[lvl]])
        spread = f"{min(ratios):.3f}–{max(ratios):.3f}" if ratios else "-"
        print(f"{lvl:>3}{_fmt(median([p[0] for p in pairs])):>10}{_fmt(median([p[1] for p in pairs])):>11}"
              f"{_fmt(ratio, '.3f'):>8}{spread:>15}"
              f"{_fmt(None if outside is None else outside * 100, '.1f') + '%':>9}")


def _print_top_level(summary: dict, runs: list[RunResult], levels: list[int]) -> None:
    """The mixed workload at the top level: continuous against serial and static."""
    by = {(r.workload, r.mode, r.level): r for r in runs}
    top = max(levels)
    cont, ser, stat = (by.get(("mixed", m, top)) for m in MODES)
    if cont and ser:
        summary["continuous_over_serial_gen_tok_s"] = cont.summary["gen_tok_s"] / ser.summary["gen_tok_s"]
        print(f"\nL={top} mixed: continuous / serial generated tok/s = "
              f"{summary['continuous_over_serial_gen_tok_s']:.2f}")
    if cont and stat:
        summary["completion_p50_ms"] = {"continuous": cont.summary["completion_p50_ms"],
                                        "static": stat.summary["completion_p50_ms"]}
        print(f"L={top} mixed: p50 completion continuous {cont.summary['completion_p50_ms']:.0f} ms, "
              f"static {stat.summary['completion_p50_ms']:.0f} ms")


def _print_memory(summary: dict, constants: dict, kv_bytes: int, rss_before_load: int, rss_after: int) -> None:
    """RSS after the runs against the model file + KV cache + allowance."""
    budget = constants["model_file_bytes"] + kv_bytes + RSS_ALLOWANCE_BYTES
    summary["memory"] = {"rss_before_load_bytes": rss_before_load, "rss_after_runs_bytes": rss_after,
                         "model_file_bytes": constants["model_file_bytes"], "kv_cache_bytes": kv_bytes,
                         "target_bytes": budget}
    mib = 1024 * 1024
    print(f"memory: RSS {rss_after / mib:.0f} MiB after the runs (before load {rss_before_load / mib:.0f} MiB); "
          f"target model {constants['model_file_bytes'] / mib:.0f} + KV {kv_bytes / mib:.0f} + 150 = {budget / mib:.0f} MiB")


def _print_shared(summary: dict, shared: dict) -> None:
    """The shared-prefix runs: prompt tokens computed and TTFT with and without the cache."""
    sh = summary["shared"] = shared["summary"]
    print(f"shared prefix: {SHARED_REQUESTS} requests × ({sh['prefix_tokens']} shared + {SHARED_SUFFIX_TOKENS}) tokens "
          f"at once: prompt tokens computed {sh['computed_on']:.0f} with the cache ({sh['computed_over_ideal']:.2f}× "
          f"prefix + suffixes = {sh['ideal_prompt_tokens']}), {sh['computed_off']:.0f} without; TTFT p95 "
          f"{sh['ttft_p95_on_ms']:.0f} vs {sh['ttft_p95_off_ms']:.0f} ms (ratio {sh['ttft_p95_ratio']:.3f}, "
          f"all {', '.join(f'{r:.3f}' for r in sh['ttft_p95_ratios'])})")
    print(f"no shared prefix (mixed L={SHARED_REQUESTS}): generated tok/s {sh['mixed_gen_tok_s_on']:.1f} with the cache, "
          f"{sh['mixed_gen_tok_s_off']:.1f} without (ratio {sh['mixed_gen_ratio']:.3f}, "
          f"all {', '.join(f'{r:.3f}' for r in sh['mixed_gen_ratios'])})")


def _print_pressure(summary: dict, pressure: dict) -> None:
    """The KV pressure run: every request whole, preemptions counted."""
    summary["pressure"] = pressure["summary"]
    p = pressure["summary"]
    print(f"pressure: ctx {p['n_ctx']} cells, {p['requests']} requests × ({PRESSURE_PROMPT_TOKENS}+{PRESSURE_GEN_TOKENS})"
          f" tokens: {p['completed']} completed, {p['with_right_token_count']} with {PRESSURE_GEN_TOKENS} tokens, "
          f"{p['preemptions']} preemptions, lost {p['lost']}, duplicated {p['duplicated']}")


def run_pressure(cfg, n_ctx: int, tokens_source: str) -> dict:
    """8 long requests into a small KV cache: all must finish whole, with preemptions counted."""
    from app.engine.llama_model import LlamaModel

    model = LlamaModel(dataclasses.replace(cfg, n_ctx=n_ctx, n_seq_max=PRESSURE_REQUESTS))
    try:
        tokens = model.tokenize(tokens_source, add_special=False)
        specs = [(_cut(tokens, PRESSURE_PROMPT_TOKENS, i), PRESSURE_GEN_TOKENS) for i in range(PRESSURE_REQUESTS)]
        run = run_workload(model, "continuous", specs, None, "pressure")
    finally:
        model.close()
    ids = [r["request_id"] for r in run.requests]
    summary = {
        "n_ctx": n_ctx,
        "requests": PRESSURE_REQUESTS,
        "completed": len(run.requests),
        "with_right_token_count": sum(r["num_completion_tokens"] == PRESSURE_GEN_TOKENS for r in run.requests),
        "preemptions": run.summary["preemptions"],
        "request_preemptions": sum(r["num_preemptions"] for r in run.requests),
        "lost": PRESSURE_REQUESTS - len(set(ids)),
        "duplicated": len(ids) - len(set(ids)) + run.summary["events_after_finish"],
        "gen_tok_s": run.summary["gen_tok_s"],
    }
    return {"summary": summary, "run": asdict(run)}
