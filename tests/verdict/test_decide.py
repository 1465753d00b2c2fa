"""Verdict rules on fixed run rows: one test per branch, and never a judgement below the household's overlap."""

from app.policy import ClassPolicy
from app.verdict.decide import Thresholds, decide, format_verdict, household_overlap

POLICIES = {
    "voice": ClassPolicy("voice", priority=0, ttft_target_ms=500),
    "chat": ClassPolicy("chat", priority=1, ttft_target_ms=1500),
    "background": ClassPolicy("background", priority=3, ttft_target_ms=30000),
}
T = Thresholds()
CURRENT = {"parallel": 8, "n_batch": 512, "mode": "continuous"}
BURST_24 = {"start_s": 1_772_395_200.0, "end_s": 1_772_395_380.0, "duration_s": 180.0, "peak": 24,
            "requests": 26, "classes": {"background": 24, "chat": 2}}


def run(mode, level, tok_s, voice_ttft_p95=100.0, bg_ttft_p95=2000.0, kv_peak=0.3, preemptions=0, run_id=None,
        slots=8):
    """A run row with only what the verdict reads."""
    return {"mode": mode, "level": level, "slots": slots,
            "run_id": run_id if run_id is not None else hash((mode, level, slots)) % 100000,
            "summary": {"gen_tok_s": tok_s, "kv_peak_util": kv_peak, "preemptions": preemptions,
                        "per_class": {"voice": {"ttft_p95_ms": voice_ttft_p95},
                                      "background": {"ttft_p95_ms": bg_ttft_p95}}}}


def curve(mode, rates, levels=(1, 2, 4, 8), **kw):
    return [run(mode, lv, r, **kw) for lv, r in zip(levels, rates)]


def traffic(overlap_share, typical, residency=(), bursts=()):
    """The request log's overlap as app.verdict.overlap.traffic reports it."""
    return {"days": 7, "busy_s": 1000.0, "typical_busy_s": 1000.0 - sum(b["duration_s"] for b in bursts),
            "overlap_share": overlap_share, "typical_overlap": typical, "burst_overlap": 8, "bursts": list(bursts),
            "busy_shares": {"1": 0.9, "2": 0.1, "4": 0.0, "8": 0.0, "16": 0.0, "32+": 0.0},
            "residency": list(residency)}


def kinds(v):
    return [r.kind for r in v.recommendations]


def test_continuous_when_overlap_gains_enough_and_interactive_ttft_holds():
    runs = curve("serial", [20, 20, 20, 20]) + curve("continuous", [20, 26, 30, 31])
    v = decide(runs, POLICIES, T, traffic(0.5, 4), CURRENT)
    assert v.level == 4 and v.overlap.overlap == 4 and v.overlap.statistic == "typical"
    rec = v.recommendations[0]
    assert rec.kind == "continuous" and rec.apply == {"mode": "continuous"}
    assert rec.numbers["gain"] == 1.5
    # Evidence points at the runs the numbers came from: continuous and serial at L=4.
    assert set(rec.evidence) == {runs[6]["run_id"], runs[2]["run_id"]}
    # The verdict names the statistic it judged at and why.
    assert rec.reasons[0].startswith("judged at 4 requests at once, for a household overlap of 4 (typical overlap")
    assert "1.50×" in format_verdict(v) and "no bursts of 8 or more" in format_verdict(v)


def test_serial_when_the_gain_is_below_the_threshold_at_the_households_overlap():
    runs = curve("serial", [20, 20, 20, 20]) + curve("continuous", [20, 22, 25, 27])
    rec = decide(runs, POLICIES, T, traffic(0.5, 4), CURRENT).recommendations[0]
    assert rec.kind == "serial" and rec.apply == {"mode": "serial"}
    assert rec.numbers["gain"] == 1.25 and rec.numbers["level"] == 4


def test_smaller_budget_when_the_gain_breaks_interactive_ttft():
    runs = curve("serial", [20, 20, 20, 20]) + curve("continuous", [20, 26, 30, 31], voice_ttft_p95=900)
    rec = decide(runs, POLICIES, T, traffic(0.5, 4), CURRENT).recommendations[0]
    assert rec.kind == "smaller_budget"
    assert rec.apply == {"mode": "continuous", "n_batch": 256}
    assert rec.numbers["misses"] == {"voice": {"ttft_p95_ms": 900, "target_ms": 500}}
    # Background is not interactive: its TTFT never counts against continuous batching.
    assert "background" not in rec.numbers["misses"]


def test_insufficient_without_serial_evidence_offers_the_run_that_settles_it():
    v = decide(curve("continuous", [20, 26, 30, 31]), POLICIES, T, traffic(0.5, 4), CURRENT)
    rec = v.recommendations[0]
    assert rec.kind == "insufficient" and rec.apply is None
    assert rec.measure == {"levels": [1, 2, 4], "modes": ["continuous", "serial"]}


def test_never_serial_below_the_typical_overlap():
    # Levels 1 and 2 gain nothing from batching, but the household runs 4 at once.
    runs = curve("serial", [20, 20], levels=(1, 2)) + curve("continuous", [20, 21], levels=(1, 2))
    v = decide(runs, POLICIES, T, traffic(0.5, 4), CURRENT)
    assert kinds(v) == ["not_enough_evidence"] and v.level is None
    rec = v.recommendations[0]
    assert rec.title == "Not enough evidence: measure at 4" and rec.apply is None
    assert rec.measure == {"levels": [1, 2, 4], "modes": ["continuous", "serial"]}
    assert rec.numbers["measured_levels"] == [1, 2] and rec.numbers["need_level"] == 4
    assert "hearth bench replay --levels 1,2,4 --modes continuous,serial" in format_verdict(v)


def test_a_burst_is_the_overlap_the_verdict_must_hold_at():
    log = traffic(0.05, 1, bursts=[BURST_24])
    ov = household_overlap(log, T)
    assert (ov.overlap, ov.statistic, ov.typical) == (24, "burst_peak", 1)
    assert "2026-03-01 20:00 UTC, 3 min: 26 requests, up to 24 at once (background 24, chat 2)" in ov.why
    # Levels 1 and 2 show no gain; with a burst of 24 in the log that is no evidence for serial.
    low = curve("serial", [20, 20], levels=(1, 2)) + curve("continuous", [20, 21], levels=(1, 2))
    v = decide(low, POLICIES, T, log, CURRENT)
    assert kinds(v) == ["not_enough_evidence"]
    rec = v.recommendations[0]
    assert rec.title == "Not enough evidence: measure at 32"
    assert rec.measure == {"levels": [1, 2, 4, 8, 16, 32], "modes": ["continuous", "serial"]}
    assert "peak of the largest burst" in rec.reasons[0]
    # Measured up to 32: judged at 32 with the runs of that level as its evidence.
    levels = (1, 2, 4, 8, 16, 32)
    full = (curve("serial", [20] * 6, levels=levels, slots=None)
            + [run("continuous", lv, r, slots=max(8, lv)) for lv, r in zip(levels, [20, 21, 25, 30, 40, 52])])
    v = decide(full, POLICIES, T, log, CURRENT)
    assert v.level == 32 and kinds(v) == ["continuous"]
    rec = v.recommendations[0]
    assert rec.numbers["gain"] == 52 / 20 and rec.numbers["statistic"] == "burst_peak"
    assert set(rec.evidence) == {full[5]["run_id"], full[11]["run_id"]}
    assert "judged at 32 requests at once, for a household overlap of 24 (peak of the largest burst)" in rec.reasons[0]
    # Serial, too, when measured at the burst's level and batching does not pay there.
    flat = curve("serial", [20] * 6, levels=levels) + curve("continuous", [20, 21, 22, 23, 24, 25], levels=levels)
    assert kinds(decide(flat, POLICIES, T, log, CURRENT)) == ["serial"]


def test_a_burst_past_the_largest_level_is_judged_at_the_largest():
    log = traffic(0.05, 1, bursts=[dict(BURST_24, peak=100, requests=100)])
    rec = decide([], POLICIES, T, log, CURRENT).recommendations[0]
    assert rec.title == "Not enough evidence: measure at 64"
    assert any("at most 64 at once" in r for r in rec.reasons)


def test_default_overlap_when_the_log_is_empty():
    assert household_overlap(None, T).overlap == 4 and household_overlap(None, T).statistic == "default"
    empty = traffic(0.0, 0) | {"busy_s": 0.0}
    assert household_overlap(empty, T).overlap == 4
    assert household_overlap(traffic(0.5, 2), T).overlap == 2
    runs = curve("serial", [20, 20, 20, 20]) + curve("continuous", [20, 26, 30, 31])
    # An overlap between measured levels is judged at the next level up; none above the top one.
    assert decide(runs, POLICIES, T, traffic(0.5, 3), CURRENT).level == 4
    v = decide(runs, POLICIES, T, traffic(0.5, 16), CURRENT)
    assert v.level is None and v.recommendations[0].title == "Not enough evidence: measure at 16"
    low = curve("serial", [20, 20], levels=(1, 2)) + curve("continuous", [20, 26], levels=(1, 2))
    assert kinds(decide(low, POLICIES, T, None, CURRENT)) == ["not_enough_evidence"]


def test_residency_first_when_requests_rarely_overlap():
    pins = [{"model": "gemma", "pin": True, "requests_per_week": 700.0, "cold_starts": 40,
             "cold_start_mean_ms": 1500.0, "cold_start_s_per_week": 60.0},
            {"model": "other", "pin": False, "requests_per_week": 3.0, "cold_starts": 0,
             "cold_start_mean_ms": None, "cold_start_s_per_week": 0.0}]
    runs = curve("serial", [20, 20, 20, 20]) + curve("continuous", [20, 26, 30, 31])
    v = decide(runs, POLICIES, T, traffic(0.02, 1, pins), CURRENT)
    assert kinds(v)[0] == "residency_first"
    rec = v.recommendations[0]
    assert rec.apply == {"model": "gemma", "policy": "pinned"}
    assert rec.numbers["overlap_share"] == 0.02 and rec.numbers["pins"][0]["cold_start_s_per_week"] == 60.0
    assert any("60.0 s/week" in r for r in rec.reasons)
    # At a typical overlap of 1 there is nothing to gain from batching either.
    assert v.level == 1 and kinds(v)[1] == "serial"


def test_rare_overlap_lets_the_largest_measured_level_stand_in():
    only_one = [run("serial", 1, 20), run("continuous", 1, 20)]
    v = decide(only_one, POLICIES, T, traffic(0.05, 2), CURRENT)
    assert v.level == 1 and kinds(v) == ["residency_first", "serial"]
    assert "requests rarely overlap, so the largest measured level (1) stands in" in v.recommendations[1].reasons[0]


def test_a_burst_means_requests_do_not_rarely_overlap():
    runs = [run("serial", 1, 20), run("continuous", 1, 20)]
    v = decide(runs, POLICIES, T, traffic(0.02, 1, bursts=[BURST_24]), CURRENT)
    assert kinds(v) == ["not_enough_evidence"]


def test_no_residency_advice_when_requests_overlap():
    runs = curve("serial", [20, 20, 20, 20]) + curve("continuous", [20, 26, 30, 31])
    assert "residency_first" not in kinds(decide(runs, POLICIES, T, traffic(0.4, 4), CURRENT))


def sweep(rates_by_slots, level=8, extra=None):
    """Serial at `level` and continuous at `level` with each slot count (extra: {slots: run keywords})."""
    return [run("serial", level, 20, slots=4)] + [run("continuous", level, r, slots=s, **(extra or {}).get(s, {}))
                                                   for s, r in rates_by_slots.items()]


def test_slot_advice_rests_on_measured_slot_counts():
    runs = sweep({4: 20.0, 8: 30.0, 16: 31.0})
    for parallel, kind, apply in ((4, "larger_slots", {"parallel": 8}), (8, "keep_slots", None),
                                  (16, "smaller_slots", {"parallel": 8})):
        v = decide(runs, POLICIES, T, traffic(0.5, 8), CURRENT | {"parallel": parallel})
        rec = v.recommendations[1]
        assert (rec.kind, rec.apply) == (kind, apply)
        assert rec.numbers["gen_tok_s_by_slots"] == {4: 20.0, 8: 30.0, 16: 31.0} and rec.numbers["pick"] == 8
        assert set(rec.evidence) == {r["run_id"] for r in runs if r["mode"] == "continuous"}
        # The batching judgement uses the continuous run at the slot count the advice picks.
        assert v.recommendations[0].numbers["continuous_slots"] == 8
        assert v.recommendations[0].numbers["gain"] == 1.5


def test_slot_advice_avoids_slot_counts_that_break_interactive_targets():
    runs = sweep({4: 20.0, 8: 30.0, 16: 40.0}, extra={16: {"voice_ttft_p95": 900}})
    rec = decide(runs, POLICIES, T, traffic(0.5, 8), CURRENT).recommendations[1]
    assert rec.numbers["pick"] == 8 and rec.kind == "keep_slots"
    assert rec.numbers["misses_by_slots"] == {16: {"voice": 900}}
    assert any("past target with 16 slots" in r for r in rec.reasons)


def test_slot_advice_says_to_sweep_further_while_throughput_still_rises():
    runs = sweep({4: 20.0, 8: 30.0, 16: 45.0})
    rec = decide(runs, POLICIES, T, traffic(0.5, 8), CURRENT).recommendations[1]
    assert (rec.kind, rec.apply) == ("larger_slots", {"parallel": 16})
    assert rec.measure == {"levels": [1, 2, 4, 8], "modes": ["continuous", "serial"], "slots": [16, 32]}
    # A full KV cache: no hint to sweep further, however steep the curve.
    full = sweep({4: 20.0, 8: 30.0, 16: 45.0}, extra={16: {"kv_peak": 0.95}})
    assert decide(full, POLICIES, T, traffic(0.5, 8), CURRENT).recommendations[1].measure is None


def test_no_slot_advice_without_a_slot_axis():
    # Throughput per level is not a slot count: without different slots at the judged level, no advice.
    runs = curve("serial", [20, 20, 20, 20]) + curve("continuous", [20, 30, 45, 70])
    assert kinds(decide(runs, POLICIES, T, traffic(0.5, 8), CURRENT)) == ["continuous"]


def test_targets_proposed_for_what_the_household_missed_at_its_overlap_through_serve():
    policies = {"voice": ClassPolicy("voice", priority=0, ttft_target_ms=500, tpot_target_ms=100),
                "chat": ClassPolicy("chat", priority=1, ttft_target_ms=1500, tpot_target_ms=150),
                "background": ClassPolicy("background", priority=3, ttft_target_ms=30000, tpot_target_ms=500)}
    runs = curve("serial", [20, 20, 20, 20]) + curve("continuous", [20, 26, 30, 31])
    serve = run("serve", 4, 30, run_id=77)
    serve["summary"]["per_class"] = {"voice": {"ttft_p95_ms": 420.0, "tpot_p95_ms": 183.0},
                                     "chat": {"ttft_p95_ms": 1490.0, "tpot_p95_ms": 140.0},
                                     "background": {"ttft_p95_ms": 90000.0, "tpot_p95_ms": 900.0}}
    v = decide(runs + [serve], policies, T, traffic(0.5, 4), CURRENT)
    (rec,) = [r for r in v.recommendations if r.kind == "targets"]
    # voice missed its TPOT (183 ms against 100): 183 × 1.25 = 228.75, up to two figures: 230. Its TTFT and all of
    # chat's were met and stay; background is not interactive (priority 3).
    assert rec.apply == {"classes": {"voice": {"tpot_target_ms": 230}}}
    assert rec.evidence == (77,) and rec.numbers["run_mode"] == "serve"
    assert rec.reasons[0] == ("voice: TTFT p95 420 ms (met today's 500 ms) → 500 ms; "
                              "TPOT p95 183 ms (missed today's 100 ms) → 230 ms")
    assert rec.numbers["per_class"]["chat"]["proposed"] == {"ttft_target_ms": 1500, "tpot_target_ms": 150}
    # Everything met: no proposal.
    serve["summary"]["per_class"]["voice"]["tpot_p95_ms"] = 95.0
    assert "targets" not in kinds(decide(runs + [serve], policies, T, traffic(0.5, 4), CURRENT))


def test_round_up_keeps_two_significant_figures():
    from app.telemetry.feasibility import round_up

    assert [round_up(x) for x in (183, 1234, 42.1, 9.2, 100, 0)] == [190, 1300, 43, 10, 100, 1]
