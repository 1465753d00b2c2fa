"""The verdict: does this household's concurrent demand justify continuous batching? Pure functions on evidence.

Evidence is the bench's run summaries (hearth runner per mode × overlap level, each with its run
id), the class policies, the thresholds (settings `verdict_*`), the overlap histogram from the
request log (app.verdict.overlap.traffic) and the model's current runner settings. Each
recommendation carries the numbers it rests on and the run ids of its raw evidence; what it
would change is in `apply` and nothing changes until an admin applies it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from app.policy import MODES, ClassPolicy

KV_ROOM = 0.8  # below this peak KV utilisation, more slots would still fit


@dataclass(frozen=True)
class Thresholds:
    """The verdict's settings (see app.store.settings.REGISTRY)."""

    min_gain: float = 1.3
    rare_overlap_share: float = 0.1
    default_overlap: int = 4
    interactive_max_priority: int = 1
    flat_gain: float = 1.1


@dataclass(frozen=True)
class Recommendation:
    """One piece of advice: what, why (with numbers), from which runs, and what Apply would change."""

    kind: str
    title: str
    reasons: tuple[str, ...]
    numbers: dict
    evidence: tuple[int, ...] = ()
    apply: dict | None = None

    def as_dict(self) -> dict:
        """Plain dict for JSON and templates."""
        return asdict(self)


@dataclass(frozen=True)
class Verdict:
    """The recommendations, the overlap they were judged at, and where that overlap came from."""

    typical_overlap: int
    overlap_source: str
    level: int | None
    recommendations: tuple[Recommendation, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict:
        """Plain dict for JSON and the store."""
        return {"typical_overlap": self.typical_overlap, "overlap_source": self.overlap_source, "level": self.level,
                "recommendations": [r.as_dict() for r in self.recommendations]}


def thresholds_from(settings: dict) -> Thresholds:
    """Thresholds from the stored settings (all_settings)."""
    return Thresholds(
        min_gain=float(settings["verdict_min_gain"]),
        rare_overlap_share=float(settings["verdict_rare_overlap_share"]),
        default_overlap=int(settings["verdict_default_overlap"]),
        interactive_max_priority=int(settings["verdict_interactive_max_priority"]),
        flat_gain=float(settings["verdict_flat_gain"]),
    )


def _run(runs: list[dict], mode: str, level: int) -> dict | None:
    return next((r for r in runs if r["mode"] == mode and r["level"] == level), None)


def _ids(*runs: dict | None) -> tuple[int, ...]:
    return tuple(r["run_id"] for r in runs if r is not None and r.get("run_id") is not None)


def interactive_misses(run: dict, policies: dict[str, ClassPolicy], t: Thresholds) -> dict[str, tuple[float, float]]:
    """Interactive classes whose p95 TTFT in this run is past their target: {class: (p95, target)}."""
    out = {}
    for name, c in run["summary"]["per_class"].items():
        p = policies.get(name)
        if p is None or p.priority > t.interactive_max_priority or c.get("ttft_p95_ms") is None:
            continue
        if c["ttft_p95_ms"] > p.ttft_target_ms:
            out[name] = (c["ttft_p95_ms"], p.ttft_target_ms)
    return out


def typical_overlap(traffic: dict | None, t: Thresholds) -> tuple[int, str]:
    """The household's typical overlap from the request log, or the default when the log is empty."""
    if traffic and traffic.get("busy_s", 0) > 0:
        return max(1, int(traffic["typical_overlap"])), f"request log, last {traffic['days']:g} days"
    return t.default_overlap, "default (no traffic in the request log yet)"


def _level_for(levels: list[int], overlap: int) -> int | None:
    """The smallest measured level at or above the overlap (the largest if none is)."""
    if not levels:
        return None
    above = [lv for lv in sorted(levels) if lv >= overlap]
    return above[0] if above else max(levels)


def residency_first(traffic: dict, t: Thresholds) -> Recommendation | None:
    """When requests rarely overlap: say so, and which models to pin for their cold-start cost."""
    if not traffic or traffic.get("busy_s", 0) <= 0 or traffic["overlap_share"] >= t.rare_overlap_share:
        return None
    pins = [r for r in traffic.get("residency", []) if r["pin"]]
    reasons = [
        (f"only {traffic['overlap_share'] * 100:.1f}% of the busy time had 2 or more requests at once "
        f"(threshold {t.rare_overlap_share * 100:.0f}%); typical overlap {traffic['typical_overlap']}"),
        ("with little overlap batching has little to share: keeping the right models resident and "
        "starting fast matter more"),
    ]
    for r in pins:
        reasons.append(f"pin {r['model']}: {r['requests_per_week']:.0f} requests/week paid {r['cold_starts']} cold "
                       f"starts (mean {r['cold_start_mean_ms'] or 0:.0f} ms), "
                       f"{r['cold_start_s_per_week']:.1f} s/week of waiting")
    top = pins[0] if pins else None
    return Recommendation(
        kind="residency_first",
        title="Requests rarely overlap: put residency first" + (f" (pin {top['model']})" if top else ""),
        reasons=tuple(reasons),
        numbers={"overlap_share": traffic["overlap_share"], "shares": traffic["shares"],
                 "typical_overlap": traffic["typical_overlap"],
                 "pins": [{k: r[k] for k in ("model", "requests_per_week", "cold_starts", "cold_start_s_per_week")}
                          for r in pins]},
        apply={"model": top["model"], "policy": "pinned"} if top else None,
    )


def batching(runs: list[dict], level: int, policies: dict[str, ClassPolicy], t: Thresholds,
             current: dict) -> Recommendation:
    """Continuous or serial at the typical overlap: the throughput gain, and the interactive tail it costs."""
    cont, ser = _run(runs, "continuous", level), _run(runs, "serial", level)
    if cont is None or ser is None or not ser["summary"].get("gen_tok_s") or not cont["summary"].get("gen_tok_s"):
        return Recommendation("insufficient", f"No verdict: continuous and serial were not both measured at L={level}",
                              (f"run the bench with --modes continuous,serial and a level ≥ {level}",), {"level": level},
                              _ids(cont, ser))
    gain = cont["summary"]["gen_tok_s"] / ser["summary"]["gen_tok_s"]
    numbers = {"level": level, "gain": gain, "continuous_gen_tok_s": cont["summary"]["gen_tok_s"],
               "serial_gen_tok_s": ser["summary"]["gen_tok_s"], "min_gain": t.min_gain,
               "continuous_ttft_p95_ms": {n: c.get("ttft_p95_ms") for n, c in cont["summary"]["per_class"].items()},
               "serial_ttft_p95_ms": {n: c.get("ttft_p95_ms") for n, c in ser["summary"]["per_class"].items()}}
    head = (f"at overlap {level}, continuous batching generates {cont['summary']['gen_tok_s']:.1f} tok/s against "
            f"{ser['summary']['gen_tok_s']:.1f} serial: {gain:.2f}× (threshold {t.min_gain:.2f}×)")
    if gain < t.min_gain:
        return Recommendation("serial", "Continuous batching is not justified at this household's overlap",
                              (head, "the gain is below the threshold: batching off (serial) serves as well"),
                              numbers, _ids(cont, ser), {"mode": "serial"})
    misses = interactive_misses(cont, policies, t)
    if not misses:
        return Recommendation("continuous", f"Use continuous batching ({gain:.2f}× the throughput at overlap {level})",
                              (head, "every interactive class keeps its p95 TTFT within target"),
                              numbers, _ids(cont, ser), {"mode": "continuous"})
    smaller = max(64, int(current.get("n_batch") or 512) // 2)
    numbers["misses"] = {n: {"ttft_p95_ms": p, "target_ms": tgt} for n, (p, tgt) in misses.items()}
    reasons = [head] + [f"but {n}'s p95 TTFT is {p:.0f} ms against a {tgt:.0f} ms target" for n, (p, tgt) in
                        misses.items()]
    reasons.append(f"a smaller per-iteration token budget (n_batch {smaller}) bounds how long a long prefill "
                   "holds back a first token (chunked prefill)")
    return Recommendation("smaller_budget", "Use continuous batching with a smaller batch budget",
                          tuple(reasons), numbers, _ids(cont, ser), {"mode": "continuous", "n_batch": smaller})


def slots(runs: list[dict], policies: dict[str, ClassPolicy], t: Thresholds, current: dict) -> Recommendation | None:
    """Smaller or larger parallel slots, where the continuous throughput curve says so."""
    curve = sorted((r for r in runs if r["mode"] == "continuous" and r["summary"].get("gen_tok_s")),
                   key=lambda r: r["level"])
    parallel = int(current.get("parallel") or 4)
    if len(curve) < 2:
        return None
    rates = {r["level"]: r["summary"]["gen_tok_s"] for r in curve}
    numbers = {"gen_tok_s_by_level": rates, "parallel": parallel, "flat_gain": t.flat_gain}
    top, prev = curve[-1], curve[-2]
    step = top["summary"]["gen_tok_s"] / prev["summary"]["gen_tok_s"]
    kv_peak = top["summary"].get("kv_peak_util")
    if top["level"] >= parallel and step >= t.flat_gain and (kv_peak is None or kv_peak < KV_ROOM):
        numbers.update(step=step, kv_peak_util=kv_peak)
        return Recommendation(
            "larger_slots", f"More parallel slots: throughput still rises at overlap {top['level']}",
            ((f"from overlap {prev['level']} to {top['level']} generated tok/s rose {step:.2f}× "
             f"(flat below {t.flat_gain:.2f}×)"),
             f"KV peak {'n/a' if kv_peak is None else f'{kv_peak * 100:.0f}%'}: room for more sequences"),
            numbers, _ids(prev, top), {"parallel": parallel * 2})
    # The knee: the first level after which no step gains flat_gain any more.
    knee = None
    for i, r in enumerate(curve[:-1]):
        if all(curve[j + 1]["summary"]["gen_tok_s"] / curve[j]["summary"]["gen_tok_s"] < t.flat_gain
               for j in range(i, len(curve) - 1)):
            knee = r
            break
    if knee is None or knee["level"] >= parallel:
        return None
    beyond = [r for r in curve if r["level"] > knee["level"]]
    hurt = {r["level"]: interactive_misses(r, policies, t) for r in beyond}
    preempted = {r["level"]: r["summary"].get("preemptions") for r in beyond if r["summary"].get("preemptions")}
    if not any(hurt.values()) and not preempted:
        return None
    numbers.update(knee=knee["level"], preemptions=preempted,
                   misses={lv: {n: p for n, (p, _) in m.items()} for lv, m in hurt.items() if m})
    reasons = [f"past overlap {knee['level']} generated tok/s gains less than {t.flat_gain:.2f}× per step"]
    if any(hurt.values()):
        reasons.append("while interactive p95 TTFT goes past target at " +
                       ", ".join(f"L={lv}" for lv, m in hurt.items() if m))
    if preempted:
        reasons.append("and the KV cache preempts sequences (" +
                       ", ".join(f"{n} at L={lv}" for lv, n in preempted.items()) + ")")
    return Recommendation("smaller_slots", f"Fewer parallel slots: {knee['level']} give the throughput",
                          tuple(reasons), numbers, _ids(knee, *beyond), {"parallel": knee["level"]})


def decide(runs: list[dict], policies: dict[str, ClassPolicy], t: Thresholds, traffic: dict | None,
           current: dict) -> Verdict:
    """All recommendations for one bench session: residency first when requests rarely overlap."""
    overlap, source = typical_overlap(traffic, t)
    hearth = [r for r in runs if r["mode"] in MODES]
    level = _level_for(sorted({r["level"] for r in hearth}), overlap)
    recs: list[Recommendation] = []
    rare = residency_first(traffic, t)
    if rare is not None:
        recs.append(rare)
    if level is not None:
        recs.append(batching(hearth, level, policies, t, current))
        s = slots(hearth, policies, t, current)
        if s is not None:
            recs.append(s)
    return Verdict(overlap, source, level, tuple(recs))


def format_verdict(v: Verdict) -> str:
    """The verdict as the CLI prints it."""
    lines = [f"verdict (typical overlap {v.typical_overlap}, from {v.overlap_source}; judged at L={v.level}):"]
    for r in v.recommendations:
        lines.append(f"  * {r.title}")
        lines += [f"      - {x}" for x in r.reasons]
        if r.apply:
            lines.append(f"      apply: {r.apply}   evidence: runs {list(r.evidence) or 'n/a'}")
    return "\n".join(lines)
