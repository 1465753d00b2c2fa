"""Overview: live number tiles (htmx polling), charts (uPlot from /api/series and /api/latency) and,
beside them, the admission policy in force — the numbers mean little without it — with each runner's
speculative decoding decision (the sampler's last read of its /props) and each class's share of draft
tokens kept over the chosen range (the request log)."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

from flask import Blueprint, current_app, render_template, request
from sqlalchemy import select

from app.engine.scheduler import SchedulerConfig
from app.engine.speculation import SpecConfig
from app.gateway.context import Services, services
from app.residency.manager import ModelState
from app.store.models import Series
from app.telemetry.feasibility import class_costs, hardware_of
from app.web.auth import login_required
from app.web.queries import Acceptance, class_acceptance, utc_now
from app.web.series import RANGES, source_label

bp = Blueprint("overview", __name__)

MIB = 1024 * 1024

# How each scheduling mode admits work (app/engine/scheduler.py), in the admin's words.
MODE_RULES = {
    "continuous": "Iteration-level: a waiting request joins at the next decode step when a slot is free.",
    "serial": "One request at a time: batching off.",
    "static": "A fixed batch is admitted only when the engine is empty and runs until its longest member ends.",
}
# The scheduler's defaults the two rules below state, read from it so the text cannot fall behind a changed default.
_SCHED = {f.name: f.default for f in fields(SchedulerConfig)}
KV_RULE = (f"A request joins only if its prompt plus {_SCHED['decode_reserve_cells']} cells per running sequence "
           "fits in the free KV cache (cached prefixes count as free: they are evicted first). A more urgent request "
           "that finds no slot or KV room preempts a preemptible, less urgent sequence (not one resumed in the last "
           f"{_SCHED['preempt_protect_s']:g} s); the preempted sequence's cells stay cached, so it resumes cheaply. "
           "When the cache fills during a step, the lowest-priority newest sequence is preempted.")
_PACE = f"{100 * _SCHED['slo_headroom']:.0f} %"
BUDGET_RULE = ("Each iteration carries one decode token per generating sequence, then prompt chunks (most "
               "urgent first) up to the prefill budget: the tokens that fit, by this model's measured cost per "
               "iteration, per decode token and per prefill token, before the next token of every decoding "
               f"sequence is due at {_PACE} of its class's TPOT target (a mean: a sequence ahead of its pace banks "
               f"time for a bigger chunk; an iteration may always take {_PACE} of the tightest target, and never "
               f"more than {_SCHED['slo_max_stall']:g} of them). A chunk is at least {_SCHED['min_prefill_tokens']} "
               "tokens unless it ends its prompt; where the target is out of reach even without prefill, prefill may "
               f"make the iteration {_SCHED['slow_machine_stretch']:g}× as long as its decode tokens alone. Prefill is "
               "never cut below the knee, the chunk size past which a bigger chunk is no cheaper per prompt token "
               "(measured on this machine): a target tighter than that allows is out of reach, and the pace kept is "
               "the reachable one. The most urgent prompt is held only to the paces of sequences at least as urgent "
               "(a voice prompt does not wait on a chat answer's pace). While nothing with a target decodes, the "
               "whole batch.")


_SPEC = {f.name: f.default for f in fields(SpecConfig)}
SPEC_RULE = ("Speculative decoding drafts tokens from the sequence's own context and verifies them in the same "
             "iteration (greedy answers are identical). The runner decides every iteration from its measured costs: "
             f"it stands aside while more than {_SPEC['max_seqs']} sequences decode, while prompts prefill, and "
             "when drafts are not worth their verification; a class switched off never drafts.")


@dataclass(frozen=True)
class Live:
    """What the box is doing now, from the sampler's latest batch and the services' state."""

    up: bool
    models: list[dict]
    resident: list[dict]
    loading: list[dict]
    gen_tok_s: float | None
    prompt_tok_s: float | None
    running: float | None
    waiting: float | None
    kv_used_pct: float | None
    preemptions_s: float | None
    gateway_waiting: int
    gateway_in_flight: int
    host: dict
    gpus: list[tuple[str, dict]]
    sample_age_s: float | None


def _sum(values: list[float]) -> float | None:
    return sum(values) if values else None


def live_state(svc: Services) -> Live:
    """The latest readings (never collects: the sampler job does) plus residency and admission state."""
    sampler = svc.sampler
    latest, latest_at = sampler.latest, sampler.latest_at
    runners = [vals for src, vals in latest.items() if src.startswith("runner:")]

    def per_runner(metric: str) -> list[float]:
        return [r[metric] for r in runners if metric in r]

    models = svc.residency.status()
    admission = svc.admission.snapshot().values()
    kv = per_runner("kv_used_pct")
    return Live(
        up=True,
        models=models,
        resident=[m for m in models if m["state"] == ModelState.READY],
        loading=[m for m in models if m["state"] == ModelState.LOADING],
        gen_tok_s=_sum(per_runner("gen_tok_s")),
        prompt_tok_s=_sum(per_runner("prompt_tok_s")),
        running=_sum(per_runner("running")),
        waiting=_sum(per_runner("waiting")),
        kv_used_pct=max(kv) if kv else None,
        preemptions_s=_sum(per_runner("preemptions_s")),
        gateway_waiting=sum(a["waiting"] for a in admission),
        gateway_in_flight=sum(a["in_flight"] for a in admission),
        host=latest.get("host", {}),
        gpus=sorted((src, vals) for src, vals in latest.items() if src.startswith("gpu:")),
        sample_age_s=None if latest_at is None else max(0.0, time.time() - latest_at),
    )


def has_gpu(svc: Services, live: Live) -> bool:
    """True when a GPU has reported now or ever (one indexed lookup in `series`)."""
    if live.gpus:
        return True
    with svc.sessions() as session:
        return session.scalar(select(Series.id).where(Series.source.startswith("gpu:")).limit(1)) is not None


def _live_budget(latest: dict, name: str, slots: int | None = None) -> dict | None:
    """The last sampled SLO budget of a model's runners (the first node that reports one), with what the
    hardware can keep (app/web/feasibility.py) once measured."""
    for source, values in sorted(latest.items()):
        if source.startswith(f"runner:{name}@") and "prefill_budget" in values:
            return {"prefill_budget": values["prefill_budget"], "tpot_ms": values.get("budget_tpot_ms") or None,
                    "hardware": hardware_of(latest, name, slots)}
    return None


def _live_speculation(svc: Services, name: str) -> dict | None:
    """A model's runner's speculative decoding as last sampled: its /props block and whether it drafted (first node)."""
    notes = svc.sampler.speculation.latest()
    latest = svc.sampler.latest
    for source, block in sorted(notes.items()):
        if source.startswith(f"runner:{name}@"):
            drafting = latest.get(source, {}).get("spec_drafting")
            return {**block, "drafting": bool(drafting) if drafting is not None else bool(block.get("drafting"))}
    return None


def speculation_setting(runner) -> str:
    """What the model's runner was started with, in words: its --spec-type, or its own default."""
    kind = runner.effective_spec_type
    if kind is None:
        return "llama-server's default" if runner.kind == "llama-server" else "off (runner default)"
    return "off" if kind == "none" else kind


def admission_policy(svc: Services, models: list[dict], acceptance: dict[str, Acceptance] | None = None) -> dict:
    """The policy in force: per servable model its runner settings, live budget and drafting decision, per class
    its priority, limits, speculation switch and the share of draft tokens kept (`acceptance`, over the range)."""
    states = {m["name"]: m for m in models}
    latest = svc.sampler.latest
    rows = []
    for name, spec in sorted(svc.catalog.model_specs().items()):
        runner = spec.runner
        rows.append({
            "name": name,
            "state": states.get(name, {}).get("state", ModelState.UNLOADED),
            "policy": spec.policy,
            "remote": len(spec.remote),
            "kind": runner.kind if runner else "remote",
            "mode": runner.mode if runner else None,
            "parallel": runner.parallel if runner else None,
            "n_batch": runner.n_batch if runner else None,
            "n_ctx": runner.n_ctx if runner else None,
            "threads": runner.threads if runner else None,
            "mode_rule": MODE_RULES.get(runner.mode, "") if runner else "Served by remote nodes.",
            "budget": _live_budget(latest, name, runner.parallel if runner else None),
            "speculation": speculation_setting(runner) if runner else None,
            "spec_live": _live_speculation(svc, name),
        })
    classes = [c for c in (svc.classes.get(n) for n in svc.classes.names()) if c is not None]
    default_model = svc.catalog.default_model_name()
    return {
        "models": rows,
        "classes": classes,
        "target_costs": class_costs(latest, classes, rows, default_model),
        "acceptance": acceptance or {},
        "max_in_flight_total": svc.settings.get("max_in_flight_total"),
        "kv_rule": KV_RULE,
        "budget_rule": BUDGET_RULE,
        "spec_rule": SPEC_RULE,
    }


@dataclass(frozen=True)
class TierCard:
    """One runner's KV tiers as its latest scrape said them (totals since the runner started)."""

    label: str
    ram_bytes: float
    ram_budget_bytes: float  # -1: no limit, 0: off
    disk_bytes: float
    disk_budget_bytes: float
    ram_entries: float
    disk_entries: float
    ram_hits: float
    disk_hits: float
    ram_restored_tokens: float
    disk_restored_tokens: float
    restore_seconds: float

    @property
    def mean_restore_ms(self) -> float | None:
        """Time per restore, disk reads included (None before the first)."""
        hits = self.ram_hits + self.disk_hits
        return 1000 * self.restore_seconds / hits if hits else None


def tier_cards(svc: Services) -> list[TierCard]:
    """Each scraped hearth runner's KV tiers from the sampler's latest batch (never collects)."""
    cards = []
    for source, t in sorted(svc.sampler.tiers.items()):
        cards.append(TierCard(label=source_label(source), **{f.name: t.get(f.name, 0.0) for f in fields(TierCard)
                                                             if f.name != "label"}))
    return cards


def range_acceptance(svc: Services, range_key: str) -> dict[str, Acceptance]:
    """Draft tokens kept per class over the overview's range, from the request log (one aggregate)."""
    end = utc_now(current_app.config.get("HEARTH_CLOCK"))
    with svc.sessions() as session:
        return class_acceptance(session, end - RANGES[range_key], end)


def _range_arg() -> str:
    value = request.args.get("range", "5m")
    return value if value in RANGES else "5m"


@bp.get("/")
@login_required
def index():
    """The overview page."""
    svc = services()
    live = live_state(svc)
    range_key = _range_arg()
    return render_template(
        "overview/index.html", live=live, gpu=has_gpu(svc, live),
        policy=admission_policy(svc, live.models, range_acceptance(svc, range_key)), range=range_key, MIB=MIB,
        tiers=tier_cards(svc),
    )


@bp.get("/partials/overview/tiles")
@login_required
def tiles():
    """The number tiles, polled by htmx every 2 s."""
    svc = services()
    live = live_state(svc)
    return render_template("overview/_tiles.html", live=live, gpu=has_gpu(svc, live), MIB=MIB)


@bp.get("/partials/overview/policy")
@login_required
def policy_panel():
    """The admission policy panel, polled every 5 s (models load and unload meanwhile)."""
    svc = services()
    range_key = _range_arg()
    return render_template("overview/_policy.html", range=range_key,
                           policy=admission_policy(svc, svc.residency.status(), range_acceptance(svc, range_key)))


@bp.get("/partials/overview/tiers")
@login_required
def tiers_panel():
    """The KV tier card, polled every 5 s."""
    return render_template("overview/_tiers.html", tiers=tier_cards(services()))
