"""One run's result and the figures derived from its raw per-request rows and samples.

`summarise` is the only place a run's figures come from, live and again from the store, so the
summary can always be re-derived from the evidence kept beside it.

Speculative decoding's figures come from the same evidence: each request's draft tokens and those
kept (the server's final `timings`: draft_n, draft_n_accepted), and the drafts counted between the
run's "before" and "after" samples (llamacpp:spec_decode_num_drafts_total). Each request's output
text is evidence too (greedy arms of one prompt must agree byte for byte); the store keeps it in
the run's summary under "outputs" (the request table has no column for it) and puts it back on the
rows before recomputing.
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass, field
from types import SimpleNamespace

from app.policy import ClassPolicy
from app.telemetry.analysis import jain_index, meets_targets
from app.telemetry.stats import quantile
from app.verdict.spec import OFF, label, split_label

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

    @property
    def base(self) -> str:
        """The target without its speculation arm: the mode, "llama-server", "serve" or "target"."""
        return split_label(self.target)[0]

    @property
    def arm(self) -> str | None:
        """The speculation arm (app.verdict.spec); None when the session had no speculation axis."""
        return split_label(self.target)[1]


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
    summary["samples"] = sum(1 for s in samples if "phase" not in s)
    # Decode speed after the first token, per request (the median one): what drafting changes on one stream.
    rates = [(t["n"] - 1) / (t["span_s"]) for t in (_decode_span(r) for r in ok) if t is not None]
    summary["decode_tok_s"] = quantile(rates, 0.5)
    summary.update(speculation(ok, samples))
    summary["outputs"] = {str(r["idx"]): r["output"] for r in requests if r.get("output") is not None}
    return summary


def _decode_span(row: dict) -> dict | None:
    """A request's tokens and the seconds from its first token to its end, when it has more than one token."""
    n = row["completion_tokens"] or 0
    if row["first_token_s"] is None or row["end_s"] is None or n < 2 or row["end_s"] <= row["first_token_s"]:
        return None
    return {"n": n, "span_s": row["end_s"] - row["first_token_s"]}


def _counter_delta(samples: list[dict], key: str) -> int | None:
    """A counter's growth over the run: last reading minus first (the phase samples bracket it)."""
    seen = [s[key] for s in samples if s.get(key) is not None]
    return int(seen[-1] - seen[0]) if len(seen) >= 2 else None


def speculation(rows: list[dict], samples: list[dict]) -> dict:
    """Draft tokens, those accepted, acceptance and tokens per draft of one run (None where nothing reports them).

    Per request the server's timings (draft_n, draft_n_accepted) count what it verified and kept; a
    request that did not draft carries neither. The drafts (verification steps) come from the
    /metrics counters, read before the first request and after the last. tokens per draft is the
    draft tokens accepted per draft: what one verification adds beyond the token decoding gives anyway.
    """
    timed = [r["server_timings"] for r in rows if isinstance(r.get("server_timings"), dict)]
    drafted = [t for t in timed if "draft_n" in t]
    draft_tokens = sum(int(t["draft_n"]) for t in drafted) if drafted else None
    accepted = sum(int(t.get("draft_n_accepted") or 0) for t in drafted) if drafted else None
    metric_tokens = _counter_delta(samples, "spec_draft_tokens_total")
    metric_accepted = _counter_delta(samples, "spec_accepted_total")
    if draft_tokens is None and metric_tokens:
        # A server whose timings do not say: its /metrics over the run.
        draft_tokens, accepted = metric_tokens, metric_accepted
    elif draft_tokens is None and timed and metric_tokens == 0:
        draft_tokens, accepted = 0, 0
    drafts = _counter_delta(samples, "spec_drafts_total")
    return {
        "spec_draft_tokens": draft_tokens,
        "spec_accepted_tokens": accepted,
        "spec_acceptance": accepted / draft_tokens if draft_tokens else None,
        "spec_drafts": drafts,
        "spec_tokens_per_draft": accepted / drafts if drafts and accepted is not None else None,
        "spec_requests_drafted": len([t for t in drafted if t.get("draft_n")]),
        "spec_rule": spec_rule(samples),
    }


RULE_DECISIONS = ("draft", "cut", "explore")


def spec_rule(samples: list[dict]) -> dict | None:
    """What a hearth runner's cost rule decided per draft source over the run (the phase samples' decision counts,
    after less before) and its last decision there (acceptance, length, tokens kept against their time's cost)."""
    phases = {s["phase"]: s.get("spec_rule") or {} for s in samples if s.get("phase")}
    after, before = phases.get("after") or {}, phases.get("before") or {}
    out = {}
    for source, now in sorted(after.items()):
        was = before.get(source, {})
        counts = {k: int(now.get(k, 0) - was.get(k, 0)) for k in RULE_DECISIONS}
        if any(counts.values()):
            out[source] = {**counts, **{k: now.get(k) for k in ("acceptance", "length", "kept_tokens", "cost_tokens")}}
    return out or None


def output_digest(text: str | None) -> str | None:
    """A short digest of one output, for tables and the verdict's evidence."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12] if text is not None else None


# Log-probability gap (nats) below which the two likeliest tokens are a near-tie (app.verdict.ties): e**0.1 ≈ 1.1,
# the two within 10 % of each other.
NEAR_TIE_NATS = 0.1


def first_difference(a: str, b: str) -> int:
    """The first character position where two texts differ (the shorter one's length if one extends the other)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def as_evidence(results: list[RunResult]) -> list[dict]:
    """Run summaries in the shape app.verdict.decide reads: mode is the target without its speculation arm."""
    return [{"mode": r.base, "spec": r.arm, "target": r.target, "level": r.level, "slots": r.slots,
             "summary": r.summary, "run_id": r.run_id, "rep": r.rep} for r in results]


def identity(runs: list[dict]) -> dict[str, dict]:
    """Each speculation arm's outputs against its target's off arm: byte-identical per request, or where not.

    runs: as_evidence's dicts, every repetition. Keyed by label; compared request by request (same
    level and idx: the same prompt) over every repetition. Hearth's off arms are also compared with
    llama-server's off arm, the differential oracle across servers. Arms with no off arm to compare
    with are left out.
    """
    off: dict[tuple[str, int], dict[str, str]] = {}
    # Every text an off arm gave per request over its repetitions: where it gave several, its greedy output is not
    # reproducible there without drafts either (batch composition, KV placement), and a drafting arm's
    # difference there says nothing of drafting.
    off_texts: dict[tuple[str, int, str], set[str]] = {}
    for r in runs:
        if r.get("spec") == OFF:
            for idx, text in (r["summary"].get("outputs") or {}).items():
                off.setdefault((r["mode"], r["level"]), {}).setdefault(idx, text)
                off_texts.setdefault((r["mode"], r["level"], idx), set()).add(text)
    out: dict[str, dict] = {}
    for r in runs:
        if r.get("spec") is None:
            continue
        ref_base = r["mode"]
        if r["spec"] == OFF:
            if r["mode"] == "llama-server":
                continue
            ref_base = "llama-server"  # hearth's off arm against stock llama-server's
        ref = off.get((ref_base, r["level"]))
        if ref is None:
            continue
        entry = out.setdefault(r["target"], {"against": label(ref_base, OFF), "compared": 0, "identical": 0,
                                             "differ": []})
        for idx, text in (r["summary"].get("outputs") or {}).items():
            if idx not in ref:
                continue
            entry["compared"] += 1
            if text == ref[idx]:
                entry["identical"] += 1
            else:
                at = first_difference(text, ref[idx])
                entry["differ"].append({"level": r["level"], "rep": r.get("rep", 0), "idx": int(idx), "at_char": at,
                                        "ours": text[max(0, at - 20): at + 40],
                                        "off": ref[idx][max(0, at - 20): at + 40],
                                        "margin": (r["summary"].get("near_ties") or {}).get(idx),
                                        "off_varies": len(off_texts.get((ref_base, r["level"], idx), ())) > 1})
    for entry in out.values():
        entry["all_identical"] = entry["compared"] > 0 and entry["identical"] == entry["compared"]
        margins = [d["margin"] for d in entry["differ"]]
        # Every difference at a near-tie of the off arm's own distribution: rounding chose, not the drafts.
        entry["near_ties_only"] = bool(margins) and all(m is not None and m <= NEAR_TIE_NATS for m in margins)
        # Every difference either on a request the off arm itself answered in more than one way, or at a near-tie.
        entry["explained"] = bool(margins) and all(d["off_varies"] or (d["margin"] is not None
                                                                         and d["margin"] <= NEAR_TIE_NATS)
                                                   for d in entry["differ"])
    return out


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
                    "peak_running": s["peak_running"], "spec": r.arm,
                    "spec_draft_tokens": s.get("spec_draft_tokens"), "spec_accepted_tokens": s.get("spec_accepted_tokens"),
                    "spec_acceptance": s.get("spec_acceptance"), "spec_drafts": s.get("spec_drafts"),
                    "spec_tokens_per_draft": s.get("spec_tokens_per_draft")})
    return out

