"""Overview: a first screen that answers a household admin's questions at a glance (htmx polling): is it working,
is anyone waiting or slow now (per class, against its target), who and what is using the box, memory and devices.
Below it, sections a person opens: charts (uPlot from /api/series and /api/latency) of throughput, latency, memory
and KV, speculation and tiers, and "how this works": the admission policy in force, with each runner's speculative
decoding decision (the sampler's last read of its /props) and each class's share of draft tokens kept over the
chosen range (the request log)."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from datetime import timedelta

from flask import Blueprint, current_app, render_template, request
from sqlalchemy import select

from app.engine.scheduler import SchedulerConfig
from app.engine.speculation import SpecConfig
from app.gateway.context import Services, services
from app.residency.manager import ModelState
from app.store.models import Series
from app.telemetry.feasibility import Hardware, class_costs, hardware_of, target_cost
from app.telemetry.stream_cost import Cost
from app.web.auth import login_required
from app.web.queries import Acceptance, Recent, class_acceptance, recent_activity, utc_now
from app.web.series import RANGES, percentile, source_label

bp = Blueprint("overview", __name__)

MIB = 1024 * 1024

# How each scheduling mode admits work (app/engine/scheduler.py), in the admin's words.
MODE_RULES = {
    "continuous": "Iteration-level: a waiting request joins at the next decode step when a slot is free.",
    "serial": "One request at a time: batching off.",
    "static": "A fixed batch is admitted only when the engine is empty and runs until its longest member ends.",
}
# The scheduler's defaults the rules below state, read from it so the text cannot fall behind a changed default.
_SCHED = {f.name: f.default for f in fields(SchedulerConfig)}
_PACE = f"{100 * _SCHED['slo_headroom']:.0f} %"
_SPEC = {f.name: f.default for f in fields(SpecConfig)}
# How admission works, in short sentences (the overview folds them behind "How this works").
BUDGET_RULE = (
    "Each step writes one token of every answer in progress, then reads prompts, most urgent first.",
    f"Prompts get what time is left before every answer's next token is due: {_PACE} of its class's TPOT target, "
    "by this model's costs as measured on this machine.",
    "An answer ahead of its pace lends its spare time to a bigger prompt piece.",
    f"A step may always take {_PACE} of the tightest target, and never more than {_SCHED['slo_max_stall']:g} of them.",
    f"A prompt piece is at least {_SCHED['min_prefill_tokens']} tokens, and never below the knee: the size past which "
    "a bigger piece is no cheaper per token.",
    "A target tighter than that is out of reach: the budget keeps the reachable pace instead of starving the prompts.",
    f"Where a target is out of reach even without prompts, a step may take {_SCHED['slow_machine_stretch']:g}× its "
    "answers' tokens alone.",
    "A prompt waits only on answers at least as urgent: a voice prompt does not wait on a chat answer's pace.",
    "While nothing with a target is being answered, the whole step goes to prompts.",
)
KV_RULE = (
    f"A request starts only if its prompt, plus {_SCHED['decode_reserve_cells']} cells for every answer in progress, "
    "fits in the free KV cache; cached prompts count as free, they are dropped first.",
    "A more urgent request that finds no slot or room pauses a preemptible, less urgent answer (not one resumed in "
    f"the last {_SCHED['preempt_protect_s']:g} s); its cells stay cached, so it resumes cheaply.",
    "When the cache fills during a step, the least urgent, newest answer is paused.",
)
SPEC_RULE = (
    "Speculative decoding guesses tokens from the answer's own context and checks them in the same step: greedy "
    "answers stay identical.",
    f"The runner decides every step from measured costs: it stands aside while more than {_SPEC['max_seqs']} answers "
    "are written, while prompts are read, and when guesses are not worth checking.",
    "A class switched off never drafts.",
)


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


# The first screen's "now": the request log's last minutes (the range picker moves the charts, not this).
GLANCE_WINDOW = timedelta(minutes=5)
# A telemetry sample older than this and the first screen says its figures may be old.
STALE_SAMPLE_S = 10


@dataclass(frozen=True)
class ClassNow:
    """One class now: its requests waiting and running, and its latency over the window against its targets."""

    name: str
    waiting: int
    running: int
    requests: int
    failed: int
    ttft_p95_ms: float | None
    ttft_target_ms: float
    tpot_p95_ms: float | None
    tpot_target_ms: float
    reach: str  # "out of reach", "measuring" (the model's pace not measured yet) or "" (in reach, or no model)
    reach_note: str

    @property
    def slow(self) -> list[str]:
        """What of this class missed its target over the window ("first token", "pace")."""
        out = []
        if self.ttft_p95_ms is not None and self.ttft_p95_ms > self.ttft_target_ms:
            out.append("first token")
        if self.tpot_p95_ms is not None and self.tpot_p95_ms > self.tpot_target_ms:
            out.append("pace")
        return out

    @property
    def state(self) -> str:
        """One word for the class: slow, failing, waiting, busy or idle."""
        if self.slow:
            return "slow"
        if self.failed:
            return "failing"
        if self.waiting:
            return "waiting"
        return "busy" if self.running or self.requests else "idle"


@dataclass(frozen=True)
class ModelNow:
    """One model now: its state, work, generated tokens/s, KV use and the pace its runner keeps with every slot busy."""

    name: str
    state: ModelState
    running: float | None
    waiting: float | None
    gen_tok_s: float | None
    kv_used_pct: float | None
    hardware: Hardware | None  # None: not measured yet (measuring while ready) or not loaded
    error: str | None


@dataclass(frozen=True)
class MemberNow:
    """One member's use: requests and generated tokens over the window, running and waiting now."""

    name: str
    requests: int
    completion_tokens: int
    running: int
    waiting: int


@dataclass(frozen=True)
class Glance:
    """The first screen: one sentence saying whether it works, then classes, models, members and devices."""

    state: str  # ok, warn, bad, neutral
    sentence: str
    classes: list[ClassNow]
    models: list[ModelNow]
    members: list[MemberNow]


@bp.app_template_filter("ms")
def fmt_ms(ms: float) -> str:
    """A latency a person reads: '340 ms' below a second, '4.6 s' from one."""
    return f"{ms / 1000:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"


def _model_now(latest: dict, row: dict, slots: int | None) -> ModelNow:
    runners = [v for src, v in latest.items() if src.startswith(f"runner:{row['name']}@")]

    def total(metric: str) -> float | None:
        values = [r[metric] for r in runners if metric in r]
        return sum(values) if values else None

    kv = [r["kv_used_pct"] for r in runners if "kv_used_pct" in r]
    return ModelNow(row["name"], row["state"], total("running"), total("waiting"), total("gen_tok_s"),
                    max(kv) if kv else None, hardware_of(latest, row["name"], slots), row.get("error"))


def _p95(values: list[float]) -> float | None:
    return percentile(sorted(values), 95) if values else None


def health(live: Live, classes: list[ClassNow], models: list[ModelNow]) -> tuple[str, str]:
    """Whether the box works, in one sentence and a state (ok, warn, bad, neutral): the worst thing first."""
    failed = [m for m in models if m.state == ModelState.FAILED]
    if failed:
        m = failed[0]
        return "bad", f"{m.name} failed to load{': ' + m.error if m.error else ''}. Its requests get an error until it loads."
    if live.sample_age_s is not None and live.sample_age_s > STALE_SAMPLE_S:
        return "warn", f"No telemetry for {live.sample_age_s:.0f} s: the sampler may be stalled, the figures below are old."
    slow = [c for c in classes if c.slow]
    if slow:
        c = slow[0]
        what = []
        if "first token" in c.slow:
            what.append(f"first token in {fmt_ms(c.ttft_p95_ms)} (p95) against {fmt_ms(c.ttft_target_ms)}")
        if "pace" in c.slow:
            what.append(f"a token every {fmt_ms(c.tpot_p95_ms)} (p95) against {fmt_ms(c.tpot_target_ms)}")
        also = f" Also slow: {', '.join(o.name for o in slow[1:])}." if slow[1:] else ""
        return "warn", f"{c.name} is slow: {' and '.join(what)} over the last {_minutes()}.{also}"
    failing = [c for c in classes if c.failed]
    if failing:
        n = sum(c.failed for c in failing)
        return "warn", (f"{n} request{'s' if n != 1 else ''} failed over the last {_minutes()} "
                        f"({', '.join(c.name for c in failing)}); the Requests page says why.")
    waiting = [c for c in classes if c.waiting]
    loading = [m.name for m in models if m.state == ModelState.LOADING]
    if loading:
        return "neutral", f"Loading {', '.join(loading)}: its requests wait until it is ready."
    if not live.resident:
        return "ok", "Working: no model is loaded yet; the first request loads one."
    if waiting:
        n = sum(c.waiting for c in waiting)
        return "ok", (f"Working: {n} request{'s' if n != 1 else ''} waiting for a slot "
                      f"({', '.join(c.name for c in waiting)}), every class within its targets.")
    return "ok", "Working: every model is ready and every class is within its targets."


def _minutes() -> str:
    return f"{GLANCE_WINDOW.total_seconds() / 60:.0f} minutes"


def glance(svc: Services, live: Live, recent: Recent) -> Glance:
    """The first screen from the live state, the class policies and the request log's last minutes."""
    latest = svc.sampler.latest
    specs = svc.catalog.model_specs()
    slots = {name: spec.runner.parallel if spec.runner else None for name, spec in specs.items()}
    models = [_model_now(latest, row, slots.get(row["name"])) for row in live.models]
    by_name = {m.name: m for m in models}
    admission = svc.admission.snapshot()
    default_model = svc.catalog.default_model_name()
    classes = []
    for c in (svc.classes.get(n) for n in svc.classes.names()):
        if c is None:
            continue
        seen = recent.classes.get(c.name)
        model = by_name.get(c.default_model or default_model or "")
        reach, note = "", ""
        if model is not None and model.hardware is not None and c.tpot_target_ms:
            cost = target_cost(c.name, c.tpot_target_ms, model.hardware)
            reach, note = ("" if cost.in_reach else "out of reach"), cost.sentence
        elif model is not None and model.state == ModelState.READY and c.tpot_target_ms:
            reach, note = "measuring", (f"{model.name}'s pace is being measured: the first answers after a load run "
                                         "cold, so whether this target is in reach is said once it is warm.")
        a = admission.get(c.name, {})
        classes.append(ClassNow(
            c.name, a.get("waiting", 0), a.get("in_flight", 0),
            len(seen.ttft_ms) if seen else 0, seen.failed if seen else 0,
            _p95(seen.ttft_ms) if seen else None, c.ttft_target_ms,
            _p95(seen.tpot_ms) if seen else None, c.tpot_target_ms, reach, note))
    classes.sort(key=lambda c: (svc.classes.get(c.name).priority, c.name))
    now_members = svc.admission.member_snapshot()
    names = sorted(set(recent.members) | set(now_members))
    members = []
    for name in names:
        used = recent.members.get(name)
        live_use = now_members.get(name, {})
        members.append(MemberNow(name, used.requests if used else 0, used.completion_tokens if used else 0,
                                 sum(v["in_flight"] for v in live_use.values()),
                                 sum(v["waiting"] for v in live_use.values())))
    members.sort(key=lambda m: (-m.running - m.waiting, -m.completion_tokens, m.name))
    state, sentence = health(live, classes, models)
    return Glance(state, sentence, classes, models, members)


def recent(svc: Services) -> Recent:
    """The request log over the first screen's window."""
    end = utc_now(current_app.config.get("HEARTH_CLOCK"))
    with svc.sessions() as session:
        return recent_activity(session, end - GLANCE_WINDOW, end)


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
        "overview/index.html", live=live, gpu=has_gpu(svc, live), glance=glance(svc, live, recent(svc)),
        policy=admission_policy(svc, live.models, range_acceptance(svc, range_key)), range=range_key, MIB=MIB,
        tiers=tier_cards(svc), devices=svc.residency.device_status(), cost=stream_cost(svc, range_key),
    )


@bp.get("/partials/overview/tiles")
@login_required
def tiles():
    """The first screen (health, classes, models, members, devices), polled by htmx every 2 s."""
    svc = services()
    live = live_state(svc)
    return render_template("overview/_tiles.html", live=live, gpu=has_gpu(svc, live), MIB=MIB,
                           glance=glance(svc, live, recent(svc)))


@bp.get("/partials/overview/policy")
@login_required
def policy_panel():
    """The admission policy panel, polled every 5 s (models load and unload meanwhile)."""
    svc = services()
    range_key = _range_arg()
    return render_template("overview/_policy.html", range=range_key,
                           policy=admission_policy(svc, svc.residency.status(), range_acceptance(svc, range_key)))


def stream_cost(svc: Services, range_key: str) -> Cost | None:
    """CPU seconds per 1,000 tokens of serve and its runners over the range (the sampler's points; never collects)."""
    cost = svc.sampler.stream_cost
    return cost.over(RANGES[range_key].total_seconds()) if cost is not None else None


@bp.get("/partials/overview/stream-cost")
@login_required
def stream_cost_panel():
    """The CPU per 1,000 tokens card, polled every 10 s."""
    range_key = _range_arg()
    return render_template("overview/_stream_cost.html", range=range_key, cost=stream_cost(services(), range_key))


@bp.get("/partials/overview/tiers")
@login_required
def tiers_panel():
    """The KV tier card, polled every 5 s."""
    return render_template("overview/_tiers.html", tiers=tier_cards(services()))


@bp.get("/partials/overview/devices")
@login_required
def devices_panel():
    """Memory per device (RAM and each GPU) and the models there, polled every 5 s."""
    return render_template("overview/_devices.html", devices=services().residency.device_status())
