"""Verdict rules on hand-made evidence: one test per branch."""

from app.policy import ClassPolicy
from app.verdict.decide import Thresholds, decide, format_verdict, typical_overlap

POLICIES = {
    "voice": ClassPolicy("voice", priority=0, ttft_target_ms=500),
    "chat": ClassPolicy("chat", priority=1, ttft_target_ms=1500),
    "background": ClassPolicy("background", priority=3, ttft_target_ms=30000),
}
T = Thresholds()
CURRENT = {"parallel": 8, "n_batch": 512, "mode": "continuous"}


def run(mode, level, tok_s, voice_ttft_p95=100.0, bg_ttft_p95=2000.0, kv_peak=0.3, preemptions=0, run_id=None):
    """A run summary with only what the verdict reads."""
    return {"mode": mode, "level": level, "run_id": run_id if run_id is not None else hash((mode, level)) % 1000,
            "summary": {"gen_tok_s": tok_s, "kv_peak_util": kv_peak, "preemptions": preemptions,
                        "per_class": {"voice": {"ttft_p95_ms": voice_ttft_p95},
                                      "background": {"ttft_p95_ms": bg_ttft_p95}}}}


def curve(mode, rates, **kw):
    return [run(mode, lv, r, **kw) for lv, r in zip((1, 2, 4, 8), rates)]


def traffic(overlap_share, typical, residency=()):
    return {"days": 7, "busy_s": 1000.0, "overlap_share": overlap_share, "typical_overlap": typical,
            "shares": {"0": 0.9, "1": 0.09, "2": 0.01, "4": 0.0, "8+": 0.0}, "residency": list(residency)}


def kinds(v):
    return [r.kind for r in v.recommendations]


def test_continuous_when_overlap_gains_enough_and_interactive_ttft_holds():
    runs = curve("serial", [20, 20, 20, 20]) + curve("continuous", [20, 26, 30, 31])
    v = decide(runs, POLICIES, T, traffic(0.5, 4), CURRENT)
    assert v.level == 4 and v.typical_overlap == 4
    rec = v.recommendations[0]
    assert rec.kind == "continuous" and rec.apply == {"mode": "continuous"}
    assert rec.numbers["gain"] == 1.5
    # Evidence points at the runs the numbers came from: continuous and serial at L=4.
    assert set(rec.evidence) == {runs[6]["run_id"], runs[2]["run_id"]}
    assert "1.50×" in format_verdict(v)


def test_serial_when_the_gain_is_below_the_threshold():
    runs = curve("serial", [20, 20, 20, 20]) + curve("continuous", [20, 22, 25, 27])
    rec = decide(runs, POLICIES, T, traffic(0.5, 4), CURRENT).recommendations[0]
    assert rec.kind == "serial" and rec.apply == {"mode": "serial"}
    assert rec.numbers["gain"] == 1.25


def test_smaller_budget_when_the_gain_breaks_interactive_ttft():
    runs = curve("serial", [20, 20, 20, 20]) + curve("continuous", [20, 26, 30, 31], voice_ttft_p95=900)
    rec = decide(runs, POLICIES, T, traffic(0.5, 4), CURRENT).recommendations[0]
    assert rec.kind == "smaller_budget"
    assert rec.apply == {"mode": "continuous", "n_batch": 256}
    assert rec.numbers["misses"] == {"voice": {"ttft_p95_ms": 900, "target_ms": 500}}
    # Background is not interactive: its TTFT never counts against continuous batching.
    assert "background" not in rec.numbers["misses"]


def test_insufficient_without_serial_evidence():
    v = decide(curve("continuous", [20, 26, 30, 31]), POLICIES, T, None, CURRENT)
    assert v.recommendations[0].kind == "insufficient" and v.recommendations[0].apply is None


def test_default_overlap_when_the_log_is_empty():
    assert typical_overlap(None, T) == (4, "default (no traffic in the request log yet)")
    empty = traffic(0.0, 0) | {"busy_s": 0.0}
    assert typical_overlap(empty, T)[0] == 4
    assert typical_overlap(traffic(0.5, 2), T) == (2, "request log, last 7 days")
    # An overlap between measured levels is judged at the next level up.
    runs = curve("serial", [20, 20, 20, 20]) + curve("continuous", [20, 26, 30, 31])
    assert decide(runs, POLICIES, T, traffic(0.5, 3), CURRENT).level == 4
    assert decide(runs, POLICIES, T, traffic(0.5, 16), CURRENT).level == 8


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


def test_no_residency_advice_when_requests_overlap():
    runs = curve("serial", [20, 20, 20, 20]) + curve("continuous", [20, 26, 30, 31])
    assert "residency_first" not in kinds(decide(runs, POLICIES, T, traffic(0.4, 4), CURRENT))


def test_larger_slots_while_throughput_still_rises_at_the_top_level():
    runs = curve("serial", [20, 20, 20, 20]) + curve("continuous", [20, 30, 45, 70])
    rec = next(r for r in decide(runs, POLICIES, T, traffic(0.5, 4), CURRENT).recommendations
               if r.kind == "larger_slots")
    assert rec.apply == {"parallel": 16}
    assert rec.numbers["step"] == 70 / 45
    # Full KV cache: no more slots however steep the curve.
    full = curve("serial", [20, 20, 20, 20]) + curve("continuous", [20, 30, 45, 70], kv_peak=0.95)
    assert "larger_slots" not in kinds(decide(full, POLICIES, T, traffic(0.5, 4), CURRENT))


def test_smaller_slots_when_the_curve_is_flat_and_tail_latency_suffers():
    runs = curve("serial", [20, 20, 20, 20]) + [
        run("continuous", 1, 20), run("continuous", 2, 30), run("continuous", 4, 31, voice_ttft_p95=800),
        run("continuous", 8, 31.5, voice_ttft_p95=1500, preemptions=3)]
    rec = next(r for r in decide(runs, POLICIES, T, traffic(0.5, 2), CURRENT).recommendations
               if r.kind == "smaller_slots")
    assert rec.apply == {"parallel": 2}
    assert rec.numbers["knee"] == 2 and rec.numbers["preemptions"] == {8: 3}
    # A flat curve alone (no latency or KV cost) does not call for fewer slots.
    calm = curve("serial", [20, 20, 20, 20]) + curve("continuous", [20, 30, 31, 31.5])
    assert "smaller_slots" not in kinds(decide(calm, POLICIES, T, traffic(0.5, 2), CURRENT))
