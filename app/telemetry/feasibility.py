"""Which class targets this hardware can keep, and what keeping each costs, in the admin's words.

The figures come from a model's runner as the sampler last read them (app/engine/scheduler.py ChunkCosts and
CostModel): the knee (prompt tokens per iteration past which a bigger chunk is no cheaper per token), the TPOT a
full batch keeps while prompts prefill at the knee, a full batch's decode iteration and a prompt token's cost. A
TPOT target tighter than the full batch's pace is out of reach at the household's busiest: the budget keeps the
reachable pace instead of starving the prompts (the overview and the Classes page mark it, with the figure).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from app.engine.scheduler import SchedulerConfig

HEADROOM = {f.name: f.default for f in fields(SchedulerConfig)}["slo_headroom"]
# Sampled metrics (app/telemetry/sampler.py) a verdict needs, all from one runner.
NEEDED = ("full_batch_tpot_ms", "full_batch_decode_ms", "prefill_token_ms", "prefill_knee")


def round_up(ms: float) -> int:
    """Up to two significant figures: 183 → 190, 1234 → 1300, 42.1 → 43 (targets a person reads)."""
    if ms <= 0:
        return 1
    scale = 10 ** max(int(math.floor(math.log10(ms))) - 1, 0)
    return int(math.ceil(ms / scale) * scale)


@dataclass(frozen=True)
class Hardware:
    """One model's runner's measured costs, as last sampled."""

    model: str
    slots: int
    full_batch_tpot_ms: float
    full_batch_decode_ms: float
    prefill_token_ms: float
    knee_tokens: int
    reachable_now_ms: float | None  # the pace the last budgeted iteration kept instead of its target (None: in reach)
    measured: bool = False  # the knee came from measured chunk costs, not the default


@dataclass(frozen=True)
class TargetCost:
    """A class's TPOT target against the hardware: whether a full batch can keep it, and what it costs."""

    class_name: str
    tpot_ms: float
    in_reach: bool
    reachable_ms: float  # the full batch's pace beside a knee chunk
    sentence: str


def hardware_of(latest: dict, model: str, slots: int | None) -> Hardware | None:
    """The first node of `model` that reports every needed figure, or None (not measured yet, or a llama-server)."""
    for source, values in sorted(latest.items()):
        if source.startswith(f"runner:{model}@") and all(values.get(k) for k in NEEDED):
            reachable = values.get("reachable_tpot_ms") or None
            return Hardware(model, slots or 1, values["full_batch_tpot_ms"], values["full_batch_decode_ms"],
                            values["prefill_token_ms"], int(values["prefill_knee"]), reachable,
                            bool(values.get("prefill_knee_measured")))
    return None


def target_cost(class_name: str, tpot_ms: float, hw: Hardware) -> TargetCost:
    """Whether `tpot_ms` is within the hardware's reach at a full batch, and its price in prefill, in one sentence."""
    reach = hw.full_batch_tpot_ms
    if tpot_ms < reach:
        sentence = (f"{class_name}: {tpot_ms:.0f} ms a token is out of reach at a full batch — {hw.slots} sequences "
                    f"decoding beside a {hw.knee_tokens}-token prompt chunk take {reach:.0f} ms a token on this "
                    "hardware, so the budget keeps that pace instead of starving the prompts.")
        return TargetCost(class_name, tpot_ms, False, reach, sentence)
    pace = tpot_ms * HEADROOM
    left_ms = max(pace - hw.full_batch_decode_ms, 0.0)
    share = left_ms / pace
    tokens = left_ms / hw.prefill_token_ms
    sentence = (f"{class_name}: keeping {tpot_ms:.0f} ms a token with {hw.slots} sequences decoding leaves prompts "
                f"{left_ms:.0f} ms of each {pace:.0f} ms iteration (about {tokens:.0f} tokens): prefill runs at "
                f"{100 * share:.0f} % of its speed while {class_name} decodes.")
    return TargetCost(class_name, tpot_ms, True, reach, sentence)


def class_costs(latest: dict, classes: list, models: list[dict], default_model: str | None) -> dict[str, TargetCost]:
    """Per class with a TPOT target, its cost on the model it is served by (its own default, else the household's).

    `models` are the overview's model rows (name, parallel); a class whose model has no measured figures yet is
    left out."""
    slots = {m["name"]: m.get("parallel") for m in models}
    hardware: dict[str, Hardware | None] = {}  # per model, looked up once: most classes share one
    out = {}
    for c in classes:
        model = c.default_model or default_model
        if model is None or not c.tpot_target_ms:
            continue
        if model not in hardware:
            hardware[model] = hardware_of(latest, model, slots.get(model))
        hw = hardware[model]
        if hw is not None:
            out[c.name] = target_cost(c.name, c.tpot_target_ms, hw)
    return out
