"""Class targets proposed from evidence: what the interactive classes actually got at the household's overlap.

A target the hardware cannot keep costs the household throughput for nothing (the SLO budget starves prefill
chasing it). The proposal, for each target the household missed, is the class's p95 TTFT or TPOT in the run
that stands for the household (through `hearth serve` when the session measured it,
else the continuous runner) at the judged level, with `HEADROOM`, rounded up to two significant figures,
shown beside today's targets with the run as evidence; Apply writes them to the classes.
"""

from __future__ import annotations

from app.policy import ClassPolicy
from app.telemetry.feasibility import round_up
from app.verdict.spec import is_off

HEADROOM = 1.25  # a proposed target leaves a quarter above what the household got: a busier minute still meets it
MIN_CHANGE = 0.1  # a proposal within 10 % of today's target is not worth the change


def _household_run(runs: list[dict], level: int) -> dict | None:
    """The run that stands for the household at `level`: through serve if measured, else the continuous runner."""
    for mode in ("serve", "continuous"):
        found = [r for r in runs if r["mode"] == mode and r["level"] == level and is_off(r.get("spec"))]
        if found:
            return found[0]
    return None


def propose_targets(runs: list[dict], level: int | None, policies: dict[str, ClassPolicy],
                    max_priority: int) -> dict | None:
    """The fields of a "targets" recommendation (app.verdict.decide.Recommendation) for the interactive classes
    (priority ≤ max_priority) at `level`, or None when no run holds their latencies or every measured figure is
    within MIN_CHANGE of today's target or meets it."""
    if level is None:
        return None
    run = _household_run(runs, level)
    if run is None:
        return None
    proposed: dict[str, dict[str, int]] = {}
    numbers: dict[str, dict] = {}
    reasons = []
    for name, c in sorted(run["summary"]["per_class"].items()):
        p = policies.get(name)
        if p is None or p.priority > max_priority:
            continue
        got = {"ttft_target_ms": c.get("ttft_p95_ms"), "tpot_target_ms": c.get("tpot_p95_ms")}
        today = {"ttft_target_ms": p.ttft_target_ms, "tpot_target_ms": p.tpot_target_ms}
        change = {}
        for key, p95 in got.items():
            if p95 is None:
                continue
            new = round_up(p95 * HEADROOM)
            # Only a missed target moves: one the household meets costs nothing to keep (and a tighter one
            # would start holding prompts back).
            if p95 > today[key] and new > (1 + MIN_CHANGE) * today[key]:
                change[key] = new
        numbers[name] = {"ttft_p95_ms": got["ttft_target_ms"], "tpot_p95_ms": got["tpot_target_ms"],
                         "today": today, "proposed": {**today, **change}}
        if not change:
            continue
        proposed[name] = change
        parts = []
        for key, label in (("ttft_target_ms", "TTFT"), ("tpot_target_ms", "TPOT")):
            p95 = got[key]
            if p95 is None:
                continue
            verb = "missed" if p95 > today[key] else "met"
            new = change.get(key, today[key])
            parts.append(f"{label} p95 {p95:.0f} ms ({verb} today's {today[key]:g} ms) → {new} ms")
        reasons.append(f"{name}: " + "; ".join(parts))
    if not proposed:
        return None
    where = "through hearth serve" if run["mode"] == "serve" else "on the continuous runner"
    reasons.append(f"From what the household's classes got {where} at {level} requests at once on this hardware, "
                   f"with {100 * (HEADROOM - 1):.0f} % headroom. A target tighter than the hardware keeps makes the "
                   "budget hold prompts back for a pace it cannot reach.")
    return {"kind": "targets", "title": "Targets this hardware keeps at the household's overlap",
            "reasons": tuple(reasons), "numbers": {"level": level, "run_mode": run["mode"], "per_class": numbers},
            "evidence": (run["run_id"],) if run.get("run_id") is not None else (), "apply": {"classes": proposed}}
