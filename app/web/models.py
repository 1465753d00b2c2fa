"""The Models page: the catalog with estimates, residency state and controls, runner logs, residency events.

Load runs in the background (a runner takes seconds to start): the POST answers at once with the
model's card in its loading state, and the card polls itself every second until the load ends;
then the server answers HTTP 286, which stops htmx's polling. Unload, policy and keep-alive edits
go through the residency manager and app.admin.set_model_policy (as `hearth models set` does),
and take effect at once (the catalog is rebuilt). The speculative decoding setting
(app.admin.set_model_speculation) is a runner flag: it applies when the model's runner next starts.
"""

from __future__ import annotations

import threading
import time

from flask import Blueprint, abort, current_app, redirect, render_template, request, url_for

from app.admin import (
    AdminError,
    placement_number_problems,
    set_model_draft,
    set_model_kv_types,
    set_model_placement,
    set_model_policy,
    set_model_speculation,
    set_model_weights,
)
from app.gateway.context import services
from app.policy import MODEL_POLICIES
from app.protocols.openai import ApiError
from app.residency.manager import RESIDENT_STATES, ModelBusy, ModelState, ResidencyError
from app.residency.pagecache import WEIGHTS_CHOICES, weights_problem
from app.residency.placement import SPLIT_MODES
from app.residency.runner_spec import SPECULATION_SETTINGS, speculation_problem
from app.services.catalog import draft_problem
from app.services.settings import memory_budget, offload_devices
from app.web.auth import login_required
from app.web.queries import EVENT_LIMIT, model_cards, recent_events

bp = Blueprint("models", __name__)

# HTTP 286: htmx stops polling the element that asked (the card, once its load is over).
STOP_POLLING = 286
# How long a Load POST waits for the manager to mark the model loading before answering.
LOAD_START_WAIT_S = 1.0
POLICY_LABELS = {"pinned": "Pinned: always resident", "keep_alive": "Keep alive: unload after the idle TTL",
                 "on_demand": "On demand: unload as soon as idle"}
# The speculative decoding choices (app.residency.runner_spec.SPECULATION_SETTINGS), in the admin's words.
SPECULATION_LABELS = {
    "auto": "Auto: n-gram lookup on Hearth's runner (the draft model, when one is chosen below), llama-server's "
            "own default on a stock one",
    "off": "Off: never draft",
    "ngram-lookup": "n-gram lookup (Hearth's): the longest recent n-gram that repeats, its continuation proposed",
    "ngram-simple": "ngram-simple: the last 12 tokens found earlier in the context, the 48 after them proposed",
    "ngram-map-k": "ngram-map-k: as ngram-simple, once that context has been seen before",
    "ngram-map-k4v": "ngram-map-k4v: llama-server's variant of ngram-map-k (the same here)",
    "ngram-mod": "ngram-mod: a table of 24-token contexts shared by every request, chained into long drafts",
}
assert tuple(SPECULATION_LABELS) == SPECULATION_SETTINGS, "a speculation setting without its label"
SPECULATION_HELP = (
    "Drafts tokens from what the request already holds (code, quoted text, JSON, a document being edited) and "
    "verifies them in the same step: a kept draft token costs no decode of its own, and greedy answers are "
    "the same. The runner decides every iteration: it drafts while few requests decode and stands aside when "
    "the batch fills (the Overview shows its decision). Applies when the model's runner next starts."
)

# The weights choices (app.residency.pagecache.WEIGHTS_CHOICES), in the admin's words.
WEIGHTS_LABELS = {
    "pinned": "Pinned: kept in the page cache always, re-read whenever RAM is checked",
    "warm": "Warm: kept in the page cache after its runner stops, while RAM is free",
    "cold": "Cold: dropped from the page cache as soon as its runner stops",
}
assert tuple(WEIGHTS_LABELS) == WEIGHTS_CHOICES, "a weights choice without its label"
WEIGHTS_HELP = (
    "Where the model file waits while no runner has it loaded. Warm and pinned weights are read ahead into "
    "the page cache (the kernel's file cache in RAM), so the next load reads memory instead of the disk; "
    "warming never takes RAM another process needs (only what is free beyond a margin) and the kernel takes "
    "it back first when something needs it. Pinned is not locked in memory (no mlock): it is re-read every "
    "minute if the kernel dropped it. Cold gives the RAM back at once."
)


def _errors() -> dict[str, str]:
    """Per model, why the last background load from this page failed (shown on its card until the next action)."""
    return current_app.extensions.setdefault("models_page_errors", {})


def _card(name: str):
    svc = services()
    with svc.sessions() as s:
        cards = model_cards(svc.catalog, svc.residency.status(), s, only=name, budget_kind=memory_budget(svc.settings).kind)
    if not cards:
        abort(404, description=f"no model '{name}' in the catalog; the page lists the models Hearth found")
    return cards[0]


def _render_card(name: str, status: int = 200, message: str | None = None, message_state: str = "ok",
                 form: dict | None = None, form_errors: dict | None = None, card=None):
    """The card after an action: alone for htmx, inside the whole page for a browser without JavaScript."""
    outcome = {"message": message, "message_state": message_state, "form": form, "form_errors": form_errors or {}}
    if not request.headers.get("HX-Request") and request.method == "POST":
        return _page({name: outcome}), status
    card = card or _card(name)
    body = render_template("models/_card.html", m=card, load_error=_errors().get(name), policies=POLICY_LABELS,
                           speculations=SPECULATION_LABELS, speculation_help=SPECULATION_HELP,
                           weights_choices=WEIGHTS_LABELS, weights_help=WEIGHTS_HELP, kv_choices=KV_CACHE_LABELS, kv_help=KV_CACHE_HELP,
                           **outcome)
    # The page's tiles (resident, memory) change with the card: they ride along as an out-of-band swap.
    return body + render_template("models/_tiles.html", oob=True, **_summary()), status


def _summary() -> dict:
    svc = services()
    budget = memory_budget(svc.settings)
    with svc.sessions() as s:
        cards = model_cards(svc.catalog, svc.residency.status(), s, budget_kind=budget.kind)
    resident = sum(c.counted_bytes for c in cards if c.state in RESIDENT_STATES and c.estimate)
    return {"cards": cards, "resident_bytes": resident, "budget_bytes": budget.usable_bytes}


def _page(outcomes: dict[str, dict] | None = None, pull_source: str | None = None) -> str:
    svc = services()
    with svc.sessions() as s:
        events = recent_events(s, EVENT_LIMIT)
    return render_template("models/index.html", events=events, models_dir=svc.catalog.models_dir, errors=_errors(),
                           policies=POLICY_LABELS, speculations=SPECULATION_LABELS, speculation_help=SPECULATION_HELP,
                           weights_choices=WEIGHTS_LABELS, weights_help=WEIGHTS_HELP, kv_choices=KV_CACHE_LABELS, kv_help=KV_CACHE_HELP,
                           outcomes=outcomes or {}, pulls=svc.library.pulls(),
                           pull_source=pull_source, **_summary(), **_voices())


def _voices() -> dict:
    """The voices and what the speech process holds now (read, never started from here)."""
    speech = services().speech
    if speech is None:
        return {"voices": [], "loaded": {}, "rtf": {}, "speech_pid": None, "speech_threads": 0, "default_voice": None}
    default = speech.find(None)
    return {"voices": speech.voices(), "default_voice": default.name if default is not None else None, "loaded": speech.process.loaded(), "rtf": dict(speech.process.rtf),
            "speech_pid": speech.process.pid, "speech_threads": speech.process.threads}


def _start_load(name: str) -> None:
    """Load `name` on a background thread; a failure is kept for its card."""
    residency = services().residency
    errors = _errors()
    errors.pop(name, None)

    def load() -> None:
        try:
            residency.load(name)
        except ResidencyError as exc:
            errors[name] = str(exc)

    threading.Thread(target=load, name=f"dashboard-load-{name}", daemon=True).start()
    # Answer with the loading state rather than the state from before the click.
    deadline = time.monotonic() + LOAD_START_WAIT_S
    while time.monotonic() < deadline and name not in errors:
        state = next((m["state"] for m in residency.status() if m["name"] == name), None)
        if state in (ModelState.LOADING, ModelState.READY, ModelState.FAILED):
            return
        time.sleep(0.02)

# The KV cache choices, K and V alike (other pairs: runner_args' -ctk/-ctv); the bytes are ggml's block sizes
# (app.engine.kv_types), the KL divergence `hearth bench kv-types` measured on the embedded Gemma 3 270M.
KV_CACHE_LABELS = {
    "f16": "f16: llama.cpp's default",
    "q8_0": "q8_0: 53 % of f16's bytes, near-lossless",
    "q4_0": "q4_0: 28 % of f16's bytes, a visible cost in accuracy",
}
KV_CACHE_HELP = (
    "The element type of the KV cache (llama-server's -ctk/-ctv, K and V alike): a smaller type holds more context "
    "in the same memory, at a cost in accuracy that `hearth bench kv-types` measures as the KL divergence of the "
    "next-token distribution against f16. A quantized V needs flash attention (llama.cpp's auto turns it on where "
    "the backend has it)."
)


@bp.get("/models")
@login_required
def index():
    """Every model Hearth found, with what it would cost and what it is doing."""
    return _page()


@bp.get("/models/<name>/card")
@login_required
def card(name: str):
    """One model's card; polled while it loads, answered with 286 once the load is over."""
    model = _card(name)
    body, _ = _render_card(name, card=model)
    return body, 200 if model.loading else STOP_POLLING


@bp.get("/models/events")
@login_required
def events():
    """The recent residency events table."""
    with services().sessions() as s:
        rows = recent_events(s, EVENT_LIMIT)
    return render_template("models/_events.html", events=rows)


def _unservable(name: str):
    """The card with a 409 when the model is in the catalog but cannot be served; None when it can."""
    if name in services().catalog.model_specs():
        return None
    card = _card(name)  # 404 when not in the catalog at all
    return _render_card(name, 409, message=f"{name} cannot be served: {card.unusable_reason or 'not usable'}",
                        message_state="bad")


@bp.post("/models/<name>/load")
@login_required
def load(name: str):
    """Start loading the model's runner; the card comes back loading and polls itself."""
    refused = _unservable(name)
    if refused:
        return refused
    _start_load(name)
    return _render_card(name)


@bp.post("/models/<name>/unload")
@login_required
def unload(name: str):
    """Stop the model's runner now (refused while it loads or serves requests)."""
    refused = _unservable(name)
    if refused:
        return refused
    _errors().pop(name, None)
    try:
        stopped = services().residency.unload(name)
    except ModelBusy as exc:
        return _render_card(name, 409, message=str(exc), message_state="bad")
    return _render_card(name, message="Unloaded: its memory is free again." if stopped else "It was not loaded.")


@bp.post("/models/<name>/policy")
@login_required
def policy(name: str):
    """Residency policy (pinned / keep-alive / on demand) and keep-alive TTL; a pinned model is loaded now."""
    _card(name)
    svc = services()
    form = {"policy": request.form.get("policy", ""), "keep_alive_s": request.form.get("keep_alive_s", "").strip()}
    errors = {}
    if form["policy"] not in MODEL_POLICIES:
        errors["policy"] = f"Choose one of: {', '.join(MODEL_POLICIES)}."
    try:
        ttl = int(form["keep_alive_s"])
    except ValueError:
        ttl = None
        errors["keep_alive_s"] = f"{form['keep_alive_s']!r} is not a whole number of seconds (e.g. 300 for five minutes)."
    if not errors:
        try:
            with svc.write_sessions() as s:
                set_model_policy(s, name, form["policy"], ttl)
                s.commit()
        except AdminError as exc:
            errors["keep_alive_s"] = str(exc)
    if errors:
        return _render_card(name, 422, form=form, form_errors=errors)
    svc.catalog.rescan()
    message = f"Saved: {POLICY_LABELS[form['policy']].lower()}" + (f", {ttl} s." if form["policy"] == "keep_alive" else ".")
    if form["policy"] == "pinned" and name in svc.catalog.model_specs():
        state = next((m["state"] for m in svc.residency.status() if m["name"] == name), None)
        if state not in RESIDENT_STATES:
            _start_load(name)
            message += " Loading it now."
    return _render_card(name, message=message)


def _save_choice(name: str, value: str, problem: str | None, store) -> tuple[object, str | None]:
    """Stores one of a model's runner choices (`store(session, name, value)`) unless `problem`; (card, problem)."""
    card = _card(name)
    if problem is None:
        try:
            with services().write_sessions() as s:
                store(s, name, value)
                s.commit()
        except AdminError as exc:
            problem = str(exc)
    if problem is None:
        services().catalog.rescan()
    return card, problem


def _choice_refused(name: str, card, field: str, value: str, problem: str):
    form = {"policy": card.policy, "keep_alive_s": int(card.keep_alive_s), field: value}
    return _render_card(name, 422, form=form, form_errors={field: problem})


def _saved(name: str, message: str):
    """The card after a runner setting was saved, saying so; a resident model is told its runner keeps the old one."""
    state = next((m["state"] for m in services().residency.status() if m["name"] == name), None)
    if state in RESIDENT_STATES:
        message += " The running runner keeps its setting until it restarts: unload and load it to apply it now."
    return _render_card(name, message=message)


@bp.post("/models/<name>/speculation")
@login_required
def speculation(name: str):
    """Speculative decoding for the model's runner: auto, off or an n-gram type (applies at its next start)."""
    value = request.form.get("speculation", "").strip().lower()
    problem = (f"Choose one of: {', '.join(SPECULATION_SETTINGS)}." if value not in SPECULATION_SETTINGS
               else speculation_problem(_card(name).runner_kind, value))
    card, problem = _save_choice(name, value, problem, set_model_speculation)
    if problem:
        return _choice_refused(name, card, "speculation", value, problem)
    message = f"Saved: speculative decoding {SPECULATION_LABELS[value].split(':')[0].lower()}."
    return _saved(name, message)


@bp.post("/models/<name>/draft")
@login_required
def draft(name: str):
    """The model's draft model: a smaller catalog model of its vocabulary, or none (applies at its next start)."""
    value = request.form.get("draft_model", "").strip()
    card = _card(name)
    problem = None
    if value and value != "none" and value not in card.draft_choices:
        other = next((e for e in services().catalog.entries if e.name == value), None)
        problem = (f"No model '{value}' in the models folder." if other is None
                   else f"{value} cannot draft for {name}: {draft_problem(_entry(name), other) or 'it is no smaller'}.")
    card, problem = _save_choice(name, value, problem, set_model_draft)
    if problem:
        return _choice_refused(name, card, "draft_model", value, problem)
    message = (f"Saved: {value} drafts for {name} while its speculative decoding is auto." if value and value != "none"
               else "Saved: no draft model.")
    return _saved(name, message)


def _entry(name: str):
    return next(e for e in services().catalog.entries if e.name == name)


@bp.post("/models/<name>/kv-cache")
@login_required
def kv_cache(name: str):
    """The model's KV cache type, K and V alike (-ctk/-ctv; applies at its runner's next start)."""
    value = request.form.get("kv_cache", "").strip().lower()
    problem = None if value in KV_CACHE_LABELS else f"Choose one of: {', '.join(KV_CACHE_LABELS)}."
    card, problem = _save_choice(name, value, problem, set_model_kv_types)
    if problem:
        return _choice_refused(name, card, "kv_cache", value, problem)
    message = f"Saved: KV cache {value}."
    return _saved(name, message)


PLACEMENT_FIELDS = ("n_cpu_moe", "devices", "tensor_split", "split_mode", "main_gpu")


def placement_problems(form: dict[str, str], gpus: list[str]) -> dict[str, str]:
    """What is wrong with each field of the placement form, in words saying what to enter; `gpus`: the GPUs the
    runners' llama.cpp build sees, by name."""
    problems = {}
    moe = form["n_cpu_moe"]
    if moe not in ("", "all") and not (moe.isdigit()):
        problems["n_cpu_moe"] = ("Experts in RAM: a number of layers, 0 or more (the first N layers' experts stay in "
                                 "RAM, as --n-cpu-moe N), or all (--cpu-moe); empty for none.")
    names = [d.strip() for d in form["devices"].split(",") if d.strip()]
    unknown = [d for d in names if d not in gpus]
    if unknown:
        seen = f"this box's GPUs are {', '.join(gpus)}" if gpus else \
            "the runners' llama.cpp build sees no GPU here (HEARTH_LLAMA_BACKEND=vulkan for an Intel or AMD one)"
        problems["devices"] = f"No GPU called {', '.join(unknown)}: {seen}. Leave empty for every GPU."
    n_gpus = len(names) or len(gpus)
    if form["tensor_split"]:
        try:
            shares = [float(x) for x in form["tensor_split"].split(",")]
        except ValueError:
            shares = [-1.0]
        if any(not x >= 0 for x in shares) or not any(shares):  # not >= : nan is neither above nor below 0
            problems["tensor_split"] = ("Split: comma-separated shares of 0 or more, one per GPU, e.g. 3,1 (three "
                                        "quarters of the layers on the first); empty to split by free memory.")
        elif len(shares) > max(n_gpus, 1):
            problems["tensor_split"] = (f"Split: {len(shares)} shares for {n_gpus} GPU(s); give one share per GPU, "
                                        "or leave it empty.")
    if form["split_mode"] not in SPLIT_MODES:
        problems["split_mode"] = f"Split mode: choose one of {', '.join(SPLIT_MODES)}."
    if not form["main_gpu"].isdigit():
        problems["main_gpu"] = "Main GPU: the index of a GPU among the model's, 0 or more."
    elif n_gpus and int(form["main_gpu"]) >= n_gpus:
        problems["main_gpu"] = f"Main GPU: {form['main_gpu']} is past the model's {n_gpus} GPU(s) (0 to {n_gpus - 1})."
    # Non-finite or absurd numbers (nan, inf, 1e308, an index past any GPU llama.cpp takes): the CLI's rule too.
    moe = int(form["n_cpu_moe"]) if form["n_cpu_moe"].isdigit() else None
    for field, problem in placement_number_problems(form["tensor_split"], form["main_gpu"], moe).items():
        problems.setdefault(field, problem[:1].upper() + problem[1:] + ".")
    return problems


@bp.post("/models/<name>/placement")
@login_required
def placement(name: str):
    """Where the model's weights go: experts in RAM (--n-cpu-moe/--cpu-moe), its GPUs (--device), their shares
    (--tensor-split), --split-mode and --main-gpu (app.admin.set_model_placement; applies at its runner's next start)."""
    form = {f: request.form.get(f, "").strip() for f in PLACEMENT_FIELDS}
    form["split_mode"] = form["split_mode"].lower() or "layer"
    form["main_gpu"] = form["main_gpu"] or "0"
    form["n_cpu_moe"] = form["n_cpu_moe"].lower()
    problems = placement_problems(form, [d.name for d in offload_devices() if d.is_gpu])
    card = _card(name)
    if not problems:
        n_cpu_moe = -1 if form["n_cpu_moe"] == "all" else int(form["n_cpu_moe"] or 0)
        try:
            with services().write_sessions() as s:
                set_model_placement(s, name, n_cpu_moe=n_cpu_moe, devices=form["devices"],
                                    tensor_split=form["tensor_split"], split_mode=form["split_mode"],
                                    main_gpu=int(form["main_gpu"]))
                s.commit()
        except AdminError as exc:
            problems["devices"] = str(exc)
    if problems:
        outcome = {"policy": card.policy, "keep_alive_s": int(card.keep_alive_s), **form}
        return _render_card(name, 422, form=outcome, form_errors=problems)
    services().catalog.rescan()
    flags = _card(name).placement_flag
    return _saved(name, "Saved: placement " + (f"({' '.join(flags)})." if flags else "at the defaults."))


@bp.post("/models/<name>/weights")
@login_required
def weights(name: str):
    """The model's weights choice: pinned, warm or cold in the page cache while no runner maps them (applies now)."""
    value = request.form.get("weights", "").strip().lower()
    problem = weights_problem(value) if value else f"choose one of: {', '.join(WEIGHTS_CHOICES)}"
    card, problem = _save_choice(name, value, problem, set_model_weights)
    if problem:
        return _choice_refused(name, card, "weights", value, f"Weights: {problem}.")
    if services().warmer is not None:
        services().warmer.check()
    return _render_card(name, message=f"Saved: weights {WEIGHTS_LABELS[value].split(':')[0].lower()}.")


@bp.post("/models/pull")
@login_required
def pull():
    """Start pulling a model into the models folder; the pulls section comes back and polls itself."""
    source = request.form.get("source", "").strip()
    if source:
        svc = services()
        svc.library.start(source, allowed_hosts=svc.settings.get("pull_allowed_hosts"))
    if not request.headers.get("HX-Request"):
        return redirect(url_for("models.index"))
    return render_template("models/_pulls.html", pulls=services().library.pulls())


@bp.get("/models/pulls")
@login_required
def pulls():
    """The pulls' progress, polled every second; 286 (stop) once none is under way."""
    rows = services().library.pulls()
    html = render_template("models/_pulls.html", pulls=rows)
    return html, 200 if any(p.active for p in rows) else STOP_POLLING


@bp.post("/models/<name>/delete")
@login_required
def delete(name: str):
    """Delete a model file of the models folder (refused while it serves, and for the embedded default model)."""
    _card(name)
    try:
        services().router.delete_model(name)
    except ApiError as err:
        return _render_card(name, err.status, message=err.message, message_state="bad")
    if not request.headers.get("HX-Request"):
        return redirect(url_for("models.index"))
    return render_template("models/_tiles.html", oob=True, **_summary())
