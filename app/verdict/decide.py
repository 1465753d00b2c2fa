"""The verdict: does this household's concurrent demand justify continuous batching? Pure functions on evidence.

Evidence is the bench's run summaries (hearth runner per mode × overlap level × slot count, each
with its run id), the class policies, the thresholds (settings `verdict_*`), the overlap
distribution and bursts from the request log (app.verdict.overlap.traffic) and the model's
current runner settings. Each recommendation carries the numbers it rests on and the run ids of
its raw evidence; what it would change is in `apply`, what it would measure next in `measure`,
and nothing changes until an admin applies it.

The verdict never judges below the household's overlap: the level it judges at is the smallest
measured one at or above it. When no measured level reaches it, the answer is "not enough
evidence: measure at N" with the run that would settle it. Only when the request log shows that
requests rarely overlap may a lower level stand in (batching then has little to share anyway).

Speculative decoding is judged on its own (`speculation`), from the runs of a speculation axis
(app.verdict.spec): one stream of repetitive work must gain, the household mix must keep its
throughput with drafting on (it stands aside when the batch fills), greedy outputs must stay
byte-identical, and the interactive classes must keep their TPOT target. Batching is judged on the
runs without drafts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from app.policy import MODES, ClassPolicy, Mode
from app.telemetry.stats import median
from app.verdict.overlap import DEFAULT_BURST_OVERLAP, LEVELS, MAX_LEVEL, TYPICAL_QUANTILE, describe_burst, is_rare, level_for
from app.verdict.proposals import propose_targets
from app.verdict.results import NEAR_TIE_NATS, identity
from app.verdict.spec import AUTO, OFF, SPEC_AUTO_HEARTH, is_off, split_label

KV_ROOM = 0.8  # below this peak KV utilisation, more slots would still fit
# The two modes the batching judgement compares, so a "measure at N" run starts exactly these.
JUDGED_MODES = (Mode.CONTINUOUS.value, Mode.SERIAL.value)
# What each statistic the household's overlap can come from is called in the verdict.
STATISTICS = {
    "burst_peak": "peak of the largest burst",
    "typical": f"typical overlap ({TYPICAL_QUANTILE * 100:.0f} % of the busy time outside bursts)",
    "default": "default overlap (the request log is empty)",
}


@dataclass(frozen=True)
class Thresholds:
    """The verdict's settings (see app.store.settings.REGISTRY)."""

    min_gain: float = 1.3
    rare_overlap_share: float = 0.1
    default_overlap: int = 4
    interactive_max_priority: int = 1
    flat_gain: float = 1.1
    burst_overlap: int = DEFAULT_BURST_OVERLAP
    # Speculative decoding: the one-stream gain it must bring, and the share of the household mix's
    # throughput it must keep (drafting stands aside when the batch fills, so it should cost nothing there).
    spec_min_gain: float = 1.1
    spec_min_mix: float = 0.98


@dataclass(frozen=True)
class Recommendation:
    """One piece of advice: what, why (with numbers), from which runs, what Apply would change, what to measure."""

    kind: str
    title: str
    reasons: tuple[str, ...]
    numbers: dict
    evidence: tuple[int, ...] = ()
    apply: dict | None = None
    measure: dict | None = None  # {"levels": [...], "modes": [...], "slots": [...]?}: the bench run that would settle it

    def as_dict(self) -> dict:
        """Plain dict for JSON and templates."""
        return asdict(self)


@dataclass(frozen=True)
class HouseholdOverlap:
    """The overlap the verdict must hold at: its value, which statistic it is, where from and why."""

    overlap: int
    statistic: str  # a key of STATISTICS
    source: str
    why: str
    typical: int | None = None  # the typical overlap outside bursts, when the log has any


@dataclass(frozen=True)
class Verdict:
    """The recommendations, the household overlap they were judged against, and the level judged at."""

    overlap: HouseholdOverlap
    level: int | None
    recommendations: tuple[Recommendation, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict:
        """Plain dict for JSON and the store."""
        o = self.overlap
        return {"household_overlap": o.overlap, "statistic": o.statistic, "statistic_label": STATISTICS[o.statistic],
                "why": o.why, "overlap_source": o.source, "typical_overlap": o.typical, "level": self.level,
                "recommendations": [r.as_dict() for r in self.recommendations]}


def thresholds_from(settings: dict) -> Thresholds:
    """Thresholds from the stored settings (all_settings)."""
    return Thresholds(
        min_gain=float(settings["verdict_min_gain"]),
        rare_overlap_share=float(settings["verdict_rare_overlap_share"]),
        default_overlap=int(settings["verdict_default_overlap"]),
        interactive_max_priority=int(settings["verdict_interactive_max_priority"]),
        flat_gain=float(settings["verdict_flat_gain"]),
        burst_overlap=int(settings.get("verdict_burst_overlap") or DEFAULT_BURST_OVERLAP),
    )


def _ids(*runs: dict | None) -> tuple[int, ...]:
    return tuple(r["run_id"] for r in runs if r is not None and r.get("run_id") is not None)


def _rate(run: dict) -> float:
    return run["summary"].get("gen_tok_s") or 0.0


def measure_up_to(level: int, slots: list[int] | None = None) -> dict:
    """The bench run that measures levels 1, 2, 4 … up to `level` in the judged modes (and slot counts)."""
    out = {"levels": [lv for lv in LEVELS if lv < level] + [level], "modes": list(JUDGED_MODES)}
    if slots:
        out["slots"] = slots
    return out


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


def household_overlap(traffic: dict | None, t: Thresholds) -> HouseholdOverlap:
    """The overlap to judge at: the largest burst's peak when the log has bursts, else the typical overlap."""
    if not traffic or traffic.get("busy_s", 0) <= 0:
        return HouseholdOverlap(t.default_overlap, "default", "default (no traffic in the request log yet)",
                                "no traffic in the request log yet: the setting verdict_default_overlap stands in")
    source = f"request log, last {traffic['days']:g} days"
    typical = traffic["typical_overlap"] if traffic.get("typical_busy_s", traffic["busy_s"]) > 0 else None
    bursts = traffic.get("bursts") or []
    if bursts:
        top = max(bursts, key=lambda b: (b["peak"], b["requests"]))
        outside = f"{typical} outside bursts" if typical else "no busy time outside bursts"
        why = (f"burst {describe_burst(top)}; serial would queue every request of a burst behind the others, "
               f"so the verdict must hold at the burst's peak, not at the typical overlap ({outside})")
        return HouseholdOverlap(top["peak"], "burst_peak", source, why, typical)
    why = (f"{TYPICAL_QUANTILE * 100:.0f} % of the busy time had at most {typical} requests at once; no bursts of "
           f"{traffic.get('burst_overlap', t.burst_overlap)} or more")
    return HouseholdOverlap(max(1, typical or 1), "typical", source, why, typical)


def residency_first(traffic: dict | None, t: Thresholds) -> Recommendation | None:
    """When requests rarely overlap (and never burst): say so, and which models to pin for their cold starts."""
    if not is_rare(traffic, t.rare_overlap_share):
        return None
    pins = [r for r in traffic.get("residency", []) if r["pin"]]
    reasons = [
        (f"only {traffic['overlap_share'] * 100:.1f}% of the busy time had 2 or more requests at once "
         f"(threshold {t.rare_overlap_share * 100:.0f}%), and no burst of {t.burst_overlap} or more; "
         f"typical overlap {traffic['typical_overlap']}"),
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
        numbers={"overlap_share": traffic["overlap_share"], "busy_shares": traffic["busy_shares"],
                 "typical_overlap": traffic["typical_overlap"],
                 "pins": [{k: r[k] for k in ("model", "requests_per_week", "cold_starts", "cold_start_s_per_week")}
                          for r in pins]},
        apply={"model": top["model"], "policy": "pinned"} if top else None,
    )


def not_enough_evidence(ov: HouseholdOverlap, levels: list[int]) -> Recommendation:
    """No verdict below the household's overlap: which level to measure, and the run that measures it."""
    need = level_for(ov.overlap)
    reasons = [f"the household's overlap is {ov.overlap} requests at once ({STATISTICS[ov.statistic]}): {ov.why}",
               (f"this session measured at most {max(levels)} at once" if levels else
                "this session measured no hearth mode"),
               ("a verdict from fewer requests at once than the household sends would not hold where it matters "
                "(batching pays where requests overlap), so none is given"),
               f"measure levels up to {need} in {' and '.join(JUDGED_MODES)}"]
    if ov.overlap > MAX_LEVEL:
        reasons.append(f"the bench measures at most {MAX_LEVEL} at once: {MAX_LEVEL} is the nearest it can judge")
    return Recommendation("not_enough_evidence", f"Not enough evidence: measure at {need}", tuple(reasons),
                          {"household_overlap": ov.overlap, "statistic": ov.statistic, "measured_levels": levels,
                           "need_level": need}, measure=measure_up_to(need))


def _slot_curve(runs: list[dict], level: int) -> list[tuple[int, dict]]:
    """Continuous runs at `level`, one per measured slot count, in slot order."""
    by: dict[int, dict] = {}
    for r in runs:
        if r["mode"] == Mode.CONTINUOUS.value and r["level"] == level and r.get("slots") and _rate(r):
            by.setdefault(int(r["slots"]), r)
    return sorted(by.items())


def slots(runs: list[dict], level: int, policies: dict[str, ClassPolicy], t: Thresholds,
          current: dict) -> Recommendation | None:
    """Fewer, more or the same parallel slots, from continuous runs at the judged level with different slot counts."""
    curve = _slot_curve(runs, level)
    if len(curve) < 2:
        return None
    parallel = int(current.get("parallel") or 4)
    rates = {s: _rate(r) for s, r in curve}
    hurt = {s: interactive_misses(r, policies, t) for s, r in curve}
    # Slot counts that keep every interactive class within target, when there are any.
    fine = [s for s, _ in curve if not hurt[s]] or [s for s, _ in curve]
    best = max(rates[s] for s in fine)
    pick = min(s for s in fine if rates[s] * t.flat_gain >= best)
    kv = {s: r["summary"].get("kv_peak_util") for s, r in curve}
    preempted = {s: r["summary"].get("preemptions") for s, r in curve if r["summary"].get("preemptions")}
    numbers = {"level": level, "gen_tok_s_by_slots": rates, "kv_peak_util_by_slots": kv,
               "preemptions_by_slots": preempted,
               "misses_by_slots": {s: {n: p for n, (p, _) in m.items()} for s, m in hurt.items() if m},
               "parallel": parallel, "flat_gain": t.flat_gain, "pick": pick}
    reasons = [f"at overlap {level}, continuous batching with " +
               ", ".join(f"{s} slots: {rates[s]:.1f} tok/s" for s, _ in curve),
               f"{pick} slots reach within {t.flat_gain:.2f}× of the best ({best:.1f} tok/s); more add little"]
    if any(hurt.values()):
        reasons.append("interactive p95 TTFT goes past target with " +
                       ", ".join(f"{s} slots" for s, m in hurt.items() if m))
    if preempted:
        reasons.append("the KV cache preempts sequences with " +
                       ", ".join(f"{s} slots ({n})" for s, n in preempted.items()))
    measure = None
    top, prev = curve[-1][0], curve[-2][0]
    step = rates[top] / rates[prev] if rates[prev] else 0.0
    if pick == top and step >= t.flat_gain and (kv[top] is None or kv[top] < KV_ROOM):
        reasons.append(f"throughput still rises {step:.2f}× from {prev} to {top} slots with KV room left: "
                       f"{2 * top} slots may pay more")
        measure = measure_up_to(level_for(level), [top, 2 * top])
    evidence = _ids(*(r for _, r in curve))
    if pick < parallel:
        return Recommendation("smaller_slots", f"Fewer parallel slots: {pick} give the throughput at overlap {level}",
                              tuple(reasons), numbers, evidence, {"parallel": pick}, measure)
    if pick > parallel:
        return Recommendation("larger_slots", f"More parallel slots: {pick} (measured at overlap {level})",
                              tuple(reasons), numbers, evidence, {"parallel": pick}, measure)
    return Recommendation("keep_slots", f"Keep {parallel} parallel slots (measured {', '.join(str(s) for s in rates)} "
                          f"at overlap {level})", tuple(reasons), numbers, evidence, None, measure)


def _continuous_at(runs: list[dict], level: int, pick: int | None, parallel: int) -> dict | None:
    """The continuous run the batching judgement uses: at the slot count the slot advice picks, else the household's."""
    at = [r for r in runs if r["mode"] == Mode.CONTINUOUS.value and r["level"] == level]
    for want in (pick, parallel):
        hit = next((r for r in at if want is not None and r.get("slots") == want), None)
        if hit is not None:
            return hit
    return max(at, key=_rate, default=None)


def batching(runs: list[dict], level: int, policies: dict[str, ClassPolicy], t: Thresholds, current: dict,
             ov: HouseholdOverlap, pick: int | None = None, slot_notes: dict[int, str] | None = None) -> Recommendation:
    """Continuous or serial at the judged level: the throughput gain, and the interactive tail it costs."""
    cont = _continuous_at(runs, level, pick, int(current.get("parallel") or 4))
    ser = next((r for r in runs if r["mode"] == Mode.SERIAL.value and r["level"] == level), None)
    if cont is None or ser is None or not _rate(ser) or not _rate(cont):
        return Recommendation("insufficient", f"No verdict: continuous and serial were not both measured at L={level}",
                              (f"run the bench with continuous and serial at levels up to {level}",),
                              {"level": level}, _ids(cont, ser), measure=measure_up_to(level))
    gain = _rate(cont) / _rate(ser)
    numbers = {"level": level, "household_overlap": ov.overlap, "statistic": ov.statistic, "gain": gain,
               "continuous_gen_tok_s": _rate(cont), "serial_gen_tok_s": _rate(ser), "min_gain": t.min_gain,
               "continuous_slots": cont.get("slots"),
               "continuous_ttft_p95_ms": {n: c.get("ttft_p95_ms") for n, c in cont["summary"]["per_class"].items()},
               "serial_ttft_p95_ms": {n: c.get("ttft_p95_ms") for n, c in ser["summary"]["per_class"].items()}}
    judged = (f"judged at {level} requests at once, for a household overlap of {ov.overlap} "
              f"({STATISTICS[ov.statistic]}): {ov.why}")
    if level < ov.overlap:
        judged += f"; requests rarely overlap, so the largest measured level ({level}) stands in"
    head = [judged, (f"at overlap {level}, continuous batching generates {_rate(cont):.1f} tok/s against "
                     f"{_rate(ser):.1f} serial: {gain:.2f}× (threshold {t.min_gain:.2f}×)")]
    slots_used = cont.get("slots")
    if slots_used and slots_used < level:
        note = (slot_notes or {}).get(level)
        head.append(f"continuous ran {slots_used} slots at overlap {level}" + (f": {note}" if note else ""))
    if gain < t.min_gain:
        return Recommendation("serial", "Continuous batching is not justified at this household's overlap",
                              (*head, "the gain is below the threshold: batching off (serial) serves as well"),
                              numbers, _ids(cont, ser), {"mode": Mode.SERIAL.value})
    misses = interactive_misses(cont, policies, t)
    if not misses:
        return Recommendation("continuous", f"Use continuous batching ({gain:.2f}× the throughput at overlap {level})",
                              (*head, "every interactive class keeps its p95 TTFT within target"),
                              numbers, _ids(cont, ser), {"mode": Mode.CONTINUOUS.value})
    smaller = max(64, int(current.get("n_batch") or 512) // 2)
    numbers["misses"] = {n: {"ttft_p95_ms": p, "target_ms": tgt} for n, (p, tgt) in misses.items()}
    reasons = head + [f"but {n}'s p95 TTFT is {p:.0f} ms against a {tgt:.0f} ms target" for n, (p, tgt) in
                      misses.items()]
    reasons.append(f"a smaller per-iteration token budget (n_batch {smaller}) bounds how long a long prefill "
                   "holds back a first token (chunked prefill)")
    return Recommendation("smaller_budget", "Use continuous batching with a smaller batch budget",
                          tuple(reasons), numbers, _ids(cont, ser), {"mode": Mode.CONTINUOUS.value, "n_batch": smaller})


def _without_drafts(runs: list[dict]) -> list[dict]:
    """The runs batching is judged on: those without drafts; with no off arm at all, the first arm's."""
    off = [r for r in runs if is_off(r.get("spec"))]
    if off or not runs:
        return off
    first = runs[0].get("spec")
    return [r for r in runs if r.get("spec") == first]


def decide(runs: list[dict], policies: dict[str, ClassPolicy], t: Thresholds, traffic: dict | None,
           current: dict, slot_notes: dict[int, str] | None = None, every_rep: list[dict] | None = None) -> Verdict:
    """All recommendations for one bench session, judged at (never below) the household's overlap.

    runs: one repetition per target × level × slots (the median one); every_rep: all of them, for
    the speculation finding's ratios within a repetition (default: runs)."""
    ov = household_overlap(traffic, t)
    spec = speculation(every_rep if every_rep is not None else runs, policies, t, current)
    hearth = [r for r in _without_drafts([r for r in runs if r["mode"] in MODES])]
    levels = sorted({r["level"] for r in hearth})
    want = min(ov.overlap, MAX_LEVEL)
    recs: list[Recommendation] = []
    rare = residency_first(traffic, t)
    if rare is not None:
        recs.append(rare)
    level = next((lv for lv in levels if lv >= want), None)
    if level is None and rare is not None and levels:
        level = max(levels)
    if _one_stream_only(runs):
        # One stream says nothing about batching: the session judges speculation alone.
        return Verdict(ov, None, tuple(recs) + ((spec,) if spec is not None else ()))
    if level is None:
        recs.append(not_enough_evidence(ov, levels))
        if spec is not None:
            recs.append(spec)
        return Verdict(ov, None, tuple(recs))
    s = slots(hearth, level, policies, t, current)
    recs.append(batching(hearth, level, policies, t, current, ov, s.numbers["pick"] if s else None, slot_notes))
    if s is not None:
        recs.append(s)
    targets = propose_targets(runs, level, policies, t.interactive_max_priority)
    if targets is not None:
        recs.append(Recommendation(**targets))
    if spec is not None:
        recs.append(spec)
    return Verdict(ov, level, tuple(recs))


def _one_stream_only(runs: list[dict]) -> bool:
    """A session of one stream (every run one request): a speculation session says nothing about batching."""
    return bool(runs) and all(r["summary"].get("requests") == 1 for r in runs) and any(
        r.get("spec") is not None for r in runs)


def _pair_key(r: dict) -> tuple:
    """Runs that pair up, on and off: same target, level, slots (serve sizes its own) and repetition."""
    return (r["mode"], r["level"], None if r["mode"] == "serve" else r.get("slots"), r.get("rep", 0))


def _spec_pairs(runs: list[dict]) -> dict[tuple[str, int, str], list[tuple[dict, dict]]]:
    """(target, level, arm) → [(on run, off run) per repetition] for every drafting arm with an off arm beside it."""
    off = {_pair_key(r): r for r in runs if r.get("spec") == OFF and _rate(r)}
    out: dict[tuple[str, int, str], list[tuple[dict, dict]]] = {}
    for r in runs:
        arm = r.get("spec")
        if arm is None or arm == OFF or not _rate(r):
            continue
        ref = off.get(_pair_key(r))
        if ref is not None:
            out.setdefault((r["mode"], r["level"], arm), []).append((r, ref))
    return out


def _arm_figures(pairs: list[tuple[dict, dict]]) -> dict:
    """One arm at one level: median ratio on/off over repetitions, each ratio, and its drafting figures."""
    ratios = [_rate(on) / _rate(off) for on, off in pairs]
    on_runs = [on for on, _ in pairs]

    def med(key: str):
        vals = [r["summary"].get(key) for r in on_runs if r["summary"].get(key) is not None]
        return median(vals) if vals else None

    decode = [on["summary"]["decode_tok_s"] / off["summary"]["decode_tok_s"] for on, off in pairs
              if on["summary"].get("decode_tok_s") and off["summary"].get("decode_tok_s")]
    return {"ratio": median(ratios), "ratios": ratios, "decode_ratio": median(decode),
            "on_gen_tok_s": median([_rate(on) for on, _ in pairs]),
            "off_gen_tok_s": median([_rate(off) for _, off in pairs]),
            "acceptance": med("spec_acceptance"), "tokens_per_draft": med("spec_tokens_per_draft"),
            "draft_tokens": med("spec_draft_tokens"), "repeats": len(pairs)}


def _interactive_tpot(run: dict, policies: dict[str, ClassPolicy], t: Thresholds) -> dict[str, tuple[float, float]]:
    """Interactive classes of a run with their p95 TPOT and target: {class: (p95, target)}."""
    out = {}
    for name, c in run["summary"]["per_class"].items():
        p = policies.get(name)
        if p is not None and p.priority <= t.interactive_max_priority and c.get("tpot_p95_ms") is not None:
            out[name] = (c["tpot_p95_ms"], p.tpot_target_ms)
    return out


def _best_llama(runs: list[dict], level: int) -> tuple[str, float] | None:
    """Stock llama-server's best arm at a level (median over repetitions): (arm, tok/s)."""
    by: dict[str, list[float]] = {}
    for r in runs:
        if r["mode"] == "llama-server" and r["level"] == level and r.get("spec") is not None and _rate(r):
            by.setdefault(r["spec"], []).append(_rate(r))
    if not by:
        return None
    arm = max(by, key=lambda a: median(by[a]))
    return arm, median(by[arm])


def speculation(runs: list[dict], policies: dict[str, ClassPolicy], t: Thresholds,
                current: dict) -> Recommendation | None:
    """Does this household gain from speculative decoding? None when the session has no on/off pair to judge.

    One stream (level 1) of repetitive work must gain at least spec_min_gain× with drafting on; the
    household mix (the largest level measured above 1, through serve when it was measured) must keep
    spec_min_mix of its throughput; greedy outputs must equal the off arm's; interactive classes must
    keep their TPOT target. Apply sets the model's speculation setting (auto for Hearth's ngram-lookup).
    """
    pairs = _spec_pairs(runs)
    hearth_pairs = {k: v for k, v in pairs.items() if k[0] in MODES or k[0] == "serve"}
    if not hearth_pairs:
        return None
    figures = {k: _arm_figures(v) for k, v in hearth_pairs.items()}
    same = identity(runs)
    setting = current.get("speculation") or AUTO

    def setting_of(arm: str) -> str:
        return AUTO if arm in (AUTO, SPEC_AUTO_HEARTH) else arm

    one = {k: f for k, f in figures.items() if k[1] == 1}
    mix_levels = sorted({k[1] for k in figures if k[1] > 1})
    mix_level = mix_levels[-1] if mix_levels else None
    mix = {k: f for k, f in figures.items() if k[1] == mix_level}
    # The mix is judged through serve (the product) when it was measured there, else on the runners.
    if any(k[0] == "serve" for k in mix):
        mix = {k: f for k, f in mix.items() if k[0] == "serve"}
    best_one = max(one.items(), key=lambda kv: kv[1]["ratio"] or 0.0, default=None)
    reasons: list[str] = []
    numbers: dict = {"one_stream": {f"{m}+{a}": f for (m, _, a), f in one.items()},
                     "mix_level": mix_level, "mix": {f"{m}+{a}": f for (m, _, a), f in mix.items()},
                     "identical": same, "spec_min_gain": t.spec_min_gain, "spec_min_mix": t.spec_min_mix,
                     "current": setting}
    evidence: list[int] = []
    for v in hearth_pairs.values():
        for on, off in v:
            evidence += [i for i in _ids(on, off) if i not in evidence]
    problems: list[str] = []
    _identity_findings(same, reasons, problems)
    if best_one is not None:
        _one_stream_findings(best_one, runs, t, numbers, reasons, problems)
    _mix_findings(mix, hearth_pairs, policies, t, numbers, reasons, problems)
    measure = _missing_measures(best_one is None, mix_level is None, reasons)
    numbers["problems"] = problems
    if problems:
        title = ("Speculative decoding changed greedy output: turn it off" if "greedy output differs" in problems[0]
                 else "Speculative decoding does not pay here: turn it off")
        return Recommendation("speculation_off", title,
                              tuple(problems + reasons), numbers, tuple(evidence),
                              None if setting == OFF else {"speculation": OFF}, measure)
    if best_one is None:
        return Recommendation("speculation_unproven", "Speculative decoding: not enough evidence",
                              tuple(reasons), numbers, tuple(evidence), None, measure)
    (_, _, arm), f = best_one
    want = setting_of(arm)
    title = (f"Use speculative decoding ({want}): {f['ratio']:.2f}× on one stream of repetitive work"
             + (f", the mix keeps {min(x['ratio'] for x in mix.values()):.2f}×" if mix else ""))
    return Recommendation("speculation_on", title, tuple(reasons), numbers, tuple(evidence),
                          None if setting == want else {"speculation": want}, measure)


def _identity_findings(same: dict, reasons: list[str], problems: list[str]) -> None:
    """Greedy outputs with drafting against without: a difference is a problem unless rounding explains it."""
    changed = {k: e for k, e in same.items() if not e["all_identical"] and e["compared"]
               and not k.endswith(f"+{OFF}")}
    for label, e in changed.items():
        d = e["differ"][0]
        line = (f"{label}'s greedy output differs from {e['against']} in {e['compared'] - e['identical']} of "
                f"{e['compared']} requests (first at character {d['at_char']}: {d['ours']!r} against {d['off']!r}"
                + (f"; there the off arm's token was {d['margin']:.3f} nats likelier" if d.get("margin") is not None
                   else "") + ")")
        if split_label(label)[0] == "llama-server":
            # Stock llama-server's own arms are a reference, not the household's runner: said, not judged.
            reasons.append(line + "; stock llama-server, for reference")
        elif e.get("explained") and any(x["off_varies"] for x in e["differ"]):
            varies = sum(1 for x in e["differ"] if x["off_varies"])
            reasons.append(line + f": the off arm's own repetitions answered {varies} of these {len(e['differ'])} "
                           "requests in more than one way (requests decoded together round otherwise than alone, "
                           "and each repetition batches them differently), the rest at near-ties: not held against "
                           "drafting")
        elif e.get("near_ties_only"):
            gaps = ", ".join(f"{x['margin']:.3f}" for x in e["differ"])
            reasons.append(line + f": each at a near-tie of the model's own choice (its two likeliest tokens there "
                           f"{gaps} nats apart, under {NEAR_TIE_NATS}): llama.cpp rounds a product of several token rows "
                           "otherwise than a one-token decode, as when two requests decode together; the drafts were "
                           "verified right")
        else:
            problems.append(line + ": drafting must never change greedy output")
    for label, e in same.items():
        if label.endswith(f"+{OFF}"):
            # Hearth without drafts against stock llama-server without drafts: the oracle across servers.
            reasons.append(f"{label}'s outputs {'equal' if e['all_identical'] else 'differ from'} {e['against']}'s "
                           f"({e['identical']} of {e['compared']} requests identical)")
        elif e["all_identical"]:
            reasons.append(f"{label}'s outputs are byte-identical to {e['against']}'s ({e['compared']} requests)")


def _one_stream_findings(best_one: tuple, runs: list[dict], t: Thresholds, numbers: dict, reasons: list[str],
                         problems: list[str]) -> None:
    """The best arm on one stream of repetitive work against spec_min_gain, and stock llama-server's best arm."""
    (m, _, arm), f = best_one
    acc = f"acceptance {f['acceptance'] * 100:.0f} %" if f["acceptance"] is not None else "acceptance n/a"
    tpd = f", {f['tokens_per_draft']:.2f} tokens per draft" if f["tokens_per_draft"] is not None else ""
    dec = f"; decoding alone {f['decode_ratio']:.2f}×" if f["decode_ratio"] is not None else ""
    reasons.append(f"one stream: {m} with {arm} generates {f['on_gen_tok_s']:.1f} tok/s against "
                   f"{f['off_gen_tok_s']:.1f} without drafts: {f['ratio']:.2f}× (median of {f['repeats']}; "
                   f"threshold {t.spec_min_gain:.2f}×{dec}); {acc}{tpd}")
    llama = _best_llama(runs, 1)
    if llama is not None:
        numbers["llama_server_best"] = {"arm": llama[0], "gen_tok_s": llama[1],
                                        "ratio": f["on_gen_tok_s"] / llama[1] if llama[1] else None}
        reasons.append(f"stock llama-server's best arm, {llama[0]}: {llama[1]:.1f} tok/s; Hearth with {arm} "
                       f"{f['on_gen_tok_s'] / llama[1]:.2f}× of it")
    if f["ratio"] < t.spec_min_gain:
        problems.append(f"one stream gains {f['ratio']:.2f}× with drafting, below the {t.spec_min_gain:.2f}× "
                        "that makes it worth having on")


def _mix_findings(mix: dict, hearth_pairs: dict, policies: dict[str, ClassPolicy], t: Thresholds, numbers: dict,
                  reasons: list[str], problems: list[str]) -> None:
    """The household mix with drafting against without (spec_min_mix), and the interactive classes' TPOT targets."""
    for (m, lv, arm), f in sorted(mix.items()):
        line = (f"household mix at {lv} at once ({m}): {f['on_gen_tok_s']:.1f} tok/s with {arm} against "
                f"{f['off_gen_tok_s']:.1f} without: {f['ratio']:.2f}× (must keep {t.spec_min_mix:.2f}×)")
        on_runs = [on for on, _ in hearth_pairs[(m, lv, arm)]]
        off_runs = [off for _, off in hearth_pairs[(m, lv, arm)]]
        if f["ratio"] < t.spec_min_mix:
            problems.append(line + ": drafting costs the full batch")
        else:
            reasons.append(line)
        on_tpot = _interactive_tpot(on_runs[len(on_runs) // 2], policies, t)
        off_tpot = _interactive_tpot(off_runs[len(off_runs) // 2], policies, t)
        numbers.setdefault("mix_tpot_p95_ms", {})[f"{m}+{arm}"] = {n: p for n, (p, _) in on_tpot.items()}
        for name, (p95, target) in on_tpot.items():
            before = off_tpot.get(name, (None, None))[0]
            if p95 > target and (before is None or before <= target):
                problems.append(f"{name}'s p95 TPOT is {p95:.0f} ms with {arm} against its {target:.0f} ms target "
                                f"({before:.0f} ms without)" if before is not None else
                                f"{name}'s p95 TPOT is {p95:.0f} ms with {arm} against its {target:.0f} ms target")
            elif p95 <= target:
                reasons.append(f"{name} keeps its TPOT target with {arm}: p95 {p95:.0f} ms ≤ {target:.0f} ms")


def _missing_measures(no_one_stream: bool, no_mix: bool, reasons: list[str]) -> dict | None:
    """What the session did not measure, said in reasons; the replay that would measure it, or None."""
    measure = None
    if no_one_stream:
        reasons.append("no one-stream run of repetitive work: the gain speculation is for was not measured")
        measure = {"scenario": "code-edit", "spec": ["off", SPEC_AUTO_HEARTH], "levels": [1], "modes": ["continuous"]}
    if no_mix:
        reasons.append("the household mix was not measured with drafting on and off: whether it stands aside "
                       "when the batch fills is unproven here (hearth bench replay --scenario household --levels 8 "
                       "--serve --spec off,auto)")
        measure = measure or {"scenario": "household", "spec": ["off", AUTO], "levels": [8], "modes": [],
                              "serve": True}
    return measure


def measure_command(m: dict) -> str:
    """The `hearth bench replay` command line of a recommendation's measure."""
    parts = ["hearth bench replay"]
    if m.get("scenario"):
        parts.append(f"--scenario {m['scenario']}")
    parts.append(f"--levels {','.join(map(str, m['levels']))}")
    parts.append(f"--modes {','.join(m['modes']) or 'none'}")
    if m.get("slots"):
        parts.append(f"--slots {','.join(map(str, m['slots']))}")
    if m.get("spec"):
        parts.append(f"--spec {','.join(m['spec'])}")
    if m.get("serve"):
        parts.append("--serve")
    return " ".join(parts)


def format_verdict(v: Verdict) -> str:
    """The verdict as the CLI prints it."""
    o = v.overlap
    judged = f"judged at L={v.level}" if v.level is not None else "not judged"
    lines = [f"verdict ({judged}; household overlap {o.overlap} = {STATISTICS[o.statistic]}, from {o.source}):",
             f"  why this statistic: {o.why}"]
    for r in v.recommendations:
        lines.append(f"  * {r.title}")
        lines += [f"      - {x}" for x in r.reasons]
        if r.apply:
            lines.append(f"      apply: {r.apply}   evidence: runs {list(r.evidence) or 'n/a'}")
        if r.measure:
            lines.append(f"      measure: {measure_command(r.measure)}")
    return "\n".join(lines)
