"""The Classes page: every request class's policy, editable, with SLO attainment and fairness over a range.

Edits go through app.admin.update_class, the same validation `hearth classes set` uses, and
apply to the gateway at once (the class registry's cache is dropped).
"""

from __future__ import annotations

from flask import (
    Blueprint,
    abort,
    current_app,
    redirect,
    render_template,
    request,
    url_for,
)

from app.admin import CLASS_FIELDS, AdminError, ClassFieldErrors, update_class
from app.gateway.context import services
from app.policy import THINKING_MODES
from app.telemetry.feasibility import class_costs
from app.web.auth import login_required
from app.web.queries import (
    RANGE_LABELS,
    RANGES,
    QueryError,
    class_acceptance,
    class_rows,
    class_stats,
    utc_now,
)

bp = Blueprint("classes", __name__)

DEFAULT_RANGE = "24h"
# The form's fields in the order shown, with their labels and help.
FORM_FIELDS = [
    ("priority", "Priority", "0 runs first; lower numbers are served before higher ones"),
    ("ttft_target_ms", "Time-to-first-token target (ms)", "a request meets its SLO when its first token comes this fast"),
    ("tpot_target_ms", "Time-per-output-token target (ms)", "…and each later token at least this fast"),
    ("default_max_tokens", "Default max tokens", "when a request does not say"),
    ("max_output_tokens", "Max output tokens", "requests asking for more are refused (400)"),
    ("max_concurrent", "Max concurrent", "requests of this class running at once"),
    ("max_queue", "Queue length", "waiting requests beyond this are refused (429)"),
    ("weight", "Fair-share weight", "share of service among classes of the same priority"),
    ("queue_timeout_s", "Queue timeout (s)", "a request waiting longer gives up (503)"),
    ("default_model", "Default model", "empty: the household default"),
    ("thinking", "Thinking", "for a request that does not say: the model's own default, off (no thoughts, a faster "
                             "answer: voice) or on; a request's think / reasoning_effort / thinking wins"),
    ("speculation", "Speculative decoding", "on: the runner drafts tokens from the context while few requests "
                                            "decode and stands aside as the batch fills (answers are the same); "
                                            "off: this class's requests never draft"),
    ("private", "Private", "yes: this class's prompts stay in the runner's memory and are never written to the KV "
                           "cache on the data volume (a conversation does not outlive the runner on disk; a resent "
                           "prompt is prefilled again after a swap or restart)"),
]


def _range() -> str:
    key = request.args.get("range", DEFAULT_RANGE)
    if key not in RANGES:
        abort(400, description=f"range must be one of {', '.join(RANGES)} (got {key!r})")
    return key


def _model_names() -> list[str]:
    """Servable model names and their aliases, as /v1/models lists them."""
    return [m["id"] for m in services().router.model_list()]


def _context(range_key: str, editing: str | None = None, values: dict | None = None,
             errors: dict | None = None, saved: str | None = None) -> dict:
    with services().sessions() as s:
        rows = class_rows(s)
        try:
            stats = class_stats(s, range_key, utc_now(current_app.config.get("HEARTH_CLOCK")))
        except QueryError as exc:
            abort(400, description=str(exc))
        acceptance = class_acceptance(s, stats.start, stats.end)
    svc = services()
    models = [{"name": name, "parallel": spec.runner.parallel if spec.runner else None}
              for name, spec in svc.catalog.model_specs().items()]
    target_costs = class_costs(svc.sampler.latest, rows, models, svc.catalog.default_model_name())
    return {"rows": rows, "stats": stats, "acceptance": acceptance, "range": range_key, "ranges": RANGE_LABELS,
            "target_costs": target_costs,
            "editing": editing,
            "values": values or {}, "errors": errors or {}, "fields": FORM_FIELDS, "saved": saved,
            "models": _model_names(), "thinking_modes": THINKING_MODES}


@bp.get("/classes")
@login_required
def index():
    """The class table with figures over the chosen range."""
    return render_template("classes/index.html", **_context(_range(), saved=request.args.get("saved")))


def _row_values(name: str) -> dict[str, str]:
    with services().sessions() as s:
        row = next((r for r in class_rows(s) if r.name == name), None)
    if row is None:
        abort(404, description=f"no class '{name}'")
    return {f: ("" if getattr(row, f) is None else str(getattr(row, f))) for f in CLASS_FIELDS}


@bp.get("/classes/<name>/edit")
@login_required
def edit(name: str):
    """The edit form of one class (a partial for htmx, inside the page without JavaScript)."""
    values = _row_values(name)
    ctx = _context(_range(), editing=name, values=values)
    if request.headers.get("HX-Request"):
        return render_template("classes/_form.html", **ctx)
    return render_template("classes/index.html", **ctx)


@bp.post("/classes/<name>")
@login_required
def save(name: str):
    """Validate and save a class; errors come back inline with what was typed kept."""
    _row_values(name)  # 404 for an unknown class
    form = request.form
    values = {f: form.get(f, "") for f in CLASS_FIELDS if f != "preemptible"}
    for kept in ("thinking", "speculation", "private"):
        if kept not in form:
            values.pop(kept)  # a form of an older page: the class keeps what it had
    # An unticked checkbox is absent from the form.
    values["preemptible"] = "yes" if form.get("preemptible") else "no"
    range_key = form.get("range") if form.get("range") in RANGES else DEFAULT_RANGE
    svc = services()
    # A default model the gateway cannot resolve would turn every request of the class into a 404.
    extra = {}
    model = values["default_model"].strip()
    if model and model not in _model_names():
        extra["default_model"] = f"no model '{model}'; choose one of {', '.join(_model_names()) or 'none'}, or leave empty"
    try:
        with svc.write_sessions() as s:
            update_class(s, name, values)
            if extra:
                raise ClassFieldErrors(extra)
            s.commit()
    except ClassFieldErrors as exc:
        ctx = _context(range_key, editing=name, values=values, errors={**exc.errors, **extra})
        template = "classes/_form.html" if request.headers.get("HX-Request") else "classes/index.html"
        return render_template(template, **ctx), 422
    except AdminError as exc:
        abort(404, description=str(exc))
    svc.classes.invalidate()
    if request.headers.get("HX-Request"):
        return render_template("classes/_saved.html", **_context(range_key, saved=name))
    return redirect(url_for("classes.index", range=range_key, saved=name))
