"""One run's result and the figures derived from its raw per-request rows and samples.

`summarise` is the only place a run's figures come from, live and again from the store, so the
summary can always be re-derived from the evidence kept beside it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from types import SimpleNamespace

from app.policy import ClassPolicy
from app.telemetry.analysis import jain_index, meets_targets
from app.telemetry.stats import quantile

# The device counts as idle below this share of its capacity (the runner's threads on a CPU).
IDLE_UTIL = 0.25


@dataclass
class RunResult:
    """One target × level: the raw rows and samples, and the summary derived from them."""

    target: str
    kind: str
    level: int
    requests: list[dict]
    samples: list[dict]
    summary: dict = field(default_factory=dict)
    run_id: int | None = None
    rep: int = 0
    slots: int | None = None  # the runner's sequence slots; None for an external target


def request_times(row: dict) -> dict:
    """TTFT, TPOT and completion (ms) of one raw row, as seen by the client."""
    ok = row["status"] == "ok" and row["end_s"] is not None
    ttft = (row["first_token_s"] - row["sent_s"]) * 1000 if ok and row["first_token_s"] is not None else None
    n = row["completion_tokens"] or 0
    tpot = ((row["end_s"] - row["first_token_s"]) * 1000 / (n - 1)
            if ttft is not None and n > 1 else None)
    done = (row["end_s"] - row["sent_s"]) * 1000 if ok else None
    return {"ttft_ms": ttft, "tpot_ms": tpot, "completion_ms": done}


def _latency(rows: list[dict]) -> dict:
    times = [request_times(r) for r in rows]
    out = {}
    for key in ("ttft_ms", "tpot_ms", "completion_ms"):
        vals = [t[key] for t in times if t[key] is not None]
        base = key[: -len("_ms")]
        out[f"{base}_p50_ms"] = quantile(vals, 0.5)
        out[f"{base}_p95_ms"] = quantile(vals, 0.95)
    return out


def summarise(requests: list[dict], samples: list[dict], policies: dict[str, ClassPolicy]) -> dict:
    """Every figure of a run from its raw rows and samples (the same function live and from the store)."""
    ok = [r for r in requests if r["status"] == "ok"]
    starts = [r["sent_s"] for r in requests if r["sent_s"] is not None]
    ends = [r["end_s"] for r in requests if r["end_s"] is not None]
    wall_s = max(ends) - min(starts) if starts and ends else 0.0
    gen = sum(r["completion_tokens"] or 0 for r in ok)
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    summary: dict = {
        "requests": len(requests),
        "ok": len(ok),
        "errors": len(requests) - len(ok),
        "wall_s": wall_s,
        "generated_tokens": gen,
        "prompt_tokens": prompt,
        "gen_tok_s": gen / wall_s if wall_s > 0 else None,
        "prompt_tok_s": prompt / wall_s if wall_s > 0 else None,
        **_latency(ok),
    }
    per_class = {}
    for name in sorted({r["class_name"] for r in requests}):
        rows = [r for r in requests if r["class_name"] == name]
        policy = policies.get(name)
        met = None
        if policy is not None:
            met = sum(meets_targets(SimpleNamespace(status=r["status"], **{k: request_times(r)[k] for k in
                                                                          ("ttft_ms", "tpot_ms")}), policy)
                      for r in rows) / len(rows)
        per_class[name] = {
            "requests": len(rows),
            "generated_tokens": sum(r["completion_tokens"] or 0 for r in rows if r["status"] == "ok"),
            "slo_attainment": met,
            "ttft_target_ms": policy.ttft_target_ms if policy else None,
            **_latency([r for r in rows if r["status"] == "ok"]),
        }
    summary["per_class"] = per_class
    # Service per class normalised by the class's weight, among classes with demand.
    summary["jain_fairness"] = jain_index(
        c["generated_tokens"] / policies[n].weight for n, c in per_class.items()
        if n in policies and policies[n].weight > 0
    )
    kv = [s["kv_util"] for s in samples if s.get("kv_util") is not None]
    summary["kv_mean_util"] = statistics.fmean(kv) if kv else None
    summary["kv_peak_util"] = max(kv) if kv else None
    pre = [s["preemptions_total"] for s in samples if s.get("preemptions_total") is not None]
    summary["preemptions"] = int(pre[-1] - pre[0]) if len(pre) >= 2 else None
    running = [s["running"] for s in samples if s.get("running") is not None]
    summary["peak_running"] = int(max(running)) if running else None
    utils = [s["util"] for s in samples if s.get("util") is not None]
    summary["util_mean"] = statistics.fmean(utils) if utils else None
    gaps = [s for s in samples if s.get("util") is not None and s["in_flight"] > 0 and s["util"] < IDLE_UTIL]
    summary["util_gap_share"] = len(gaps) / len(utils) if utils else None
    summary["samples"] = len(samples)
    return summary


def median_runs(results: list[RunResult]) -> list[RunResult]:
    """One run per target × level × slots: the repetition with the median generated tok/s (a real run, not a blend)."""
    groups: dict[tuple[str, int, int | None], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.target, r.level, r.slots), []).append(r)
    out = []
    for runs in groups.values():
        ordered = sorted(runs, key=lambda r: r.summary.get("gen_tok_s") or 0.0)
        out.append(ordered[(len(ordered) - 1) // 2])
    return out


def summary_rows(results: list[RunResult]) -> list[dict]:
    """One flat row per run for tables and CSV."""
    out = []
    for r in results:
        s = r.summary
        out.append({"target": r.target, "level": r.level, "slots": r.slots, "requests": s["requests"],
                    "errors": s["errors"],
                    "wall_s": s["wall_s"], "gen_tok_s": s["gen_tok_s"], "prompt_tok_s": s["prompt_tok_s"],
                    "ttft_p50_ms": s["ttft_p50_ms"], "ttft_p95_ms": s["ttft_p95_ms"],
                    "tpot_p50_ms": s["tpot_p50_ms"], "tpot_p95_ms": s["tpot_p95_ms"],
                    "completion_p50_ms": s["completion_p50_ms"], "completion_p95_ms": s["completion_p95_ms"],
                    "kv_mean_util": s["kv_mean_util"], "kv_peak_util": s["kv_peak_util"],
                    "preemptions": s["preemptions"], "jain_fairness": s["jain_fairness"],
                    "util_mean": s["util_mean"], "util_gap_share": s["util_gap_share"],
                    "peak_running": s["peak_running"]})
    return out

