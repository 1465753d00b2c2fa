"""The Bench page: the household's overlap, start a replay (background job, live progress), sessions, verdict, Apply.

The job runs app.verdict.replay.run_bench in one background thread per `hearth serve` (a second
Start while one runs is refused with 409); its progress lives in memory and its runs in the store
as each one ends. When the job ends, the progress poll's last answer also swaps in the finished
session and the past-runs list (htmx out-of-band), so the page shows it without a reload. Views
read the store; Apply is a POST with CSRF that changes runner settings (the speculation setting
included) and records who applied what; a verdict's "measure" is a Start with the scenario, levels,
modes, slots and speculation arms it names. A session with a speculation axis also shows each arm:
its throughput over its own off arm, acceptance, tokens per draft and whether its greedy outputs
are byte-identical to the off arm's.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import threading
import time
from dataclasses import dataclass, field

from flask import (
    Blueprint,
    Response,
    abort,
    current_app,
    flash,
    redirect,
    render_template,
    request,
    url_for,
)

from app.gateway.context import services
from app.llama_tools import stock_llama_server
from app.policy import MODES
from app.store.models import BenchRun, BenchSession
from app.verdict import sessions as store
from app.verdict.decide import thresholds_from
from app.verdict.overlap import BUCKET_LABELS, BUCKETS, MAX_LEVEL, describe_burst, is_rare
from app.verdict.overlap import traffic as read_traffic
from app.verdict.replay import BenchConfig, run_bench, total_runs
from app.verdict.results import RunResult, request_times
from app.verdict.scenarios import ScenarioError, load_scenario, shipped_names
from app.verdict.spec import DEFAULT_LLAMA_SPEC, SpecAxisError, parse_arms
from app.verdict.tables import spec_rows
from app.web.auth import login_required

log = logging.getLogger(__name__)

bp = Blueprint("bench", __name__)

MAX_SLOTS = 256
TRAFFIC_DAYS = BenchConfig.traffic_days
MAX_BURSTS_SHOWN = 5
CHART_METRICS = {"gen_tok_s": "tok/s", "ttft_p95_ms": "ms", "kv_peak_util": "", "kv_mean_util": "",
                 "completion_p95_ms": "ms"}
# htmx stops polling on this status (the partial then stays as it is).
STOP_POLLING = 286


@dataclass
class BenchJob:
    """The one bench run in progress (or the last one) of this process."""

    scenario: str
    total: int
    done: int = 0
    session_id: int | None = None
    last: str = "starting runners…"
    error: str | None = None
    finished: bool = False
    started_s: float = field(default_factory=time.monotonic)


def _jobs() -> dict:
    return current_app.extensions.setdefault("hearth_bench", {"job": None, "lock": threading.Lock()})


def _counts(text: str, what: str, most: int) -> tuple[int, ...]:
    """Comma-separated whole numbers between 1 and `most`, or a 400 that says so."""
    try:
        values = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        abort(400, description=f"{what}: comma-separated whole numbers, e.g. 1,2,4,8 (got {text!r})")
    if not values or min(values) < 1 or max(values) > most:
        abort(400, description=f"{what}: between 1 and {most} (got {text!r})")
    return values


def _start_thread(app, cfg: BenchConfig, job: BenchJob) -> threading.Thread:
    sessions = services(app).sessions

    def progress(run: RunResult, done: int, total: int) -> None:
        job.done = done
        job.total = total
        job.session_id = job.session_id or _session_of(sessions, run.run_id)
        rate = run.summary.get("gen_tok_s")
        job.last = f"{run.target} L={run.level}: {rate:.1f} tok/s" if rate else f"{run.target} L={run.level}"

    def work() -> None:
        try:
            outcome = run_bench(cfg, sessions, progress=progress, log=lambda line: setattr(job, "last", line))
            job.session_id = outcome.session_id
        # Whatever fails, the page must say so instead of the thread dying unseen, and the log keeps
        # the traceback the page's one line cannot show.
        except Exception as exc:  # noqa: BLE001
            log.exception("bench: the %s replay failed", cfg.scenario)
            job.error = f"{type(exc).__name__}: {exc}"
        finally:
            job.finished = True

    t = threading.Thread(target=work, name="hearth-bench", daemon=True)
    t.start()
    return t


def _session_of(sessions, run_id: int | None) -> int | None:
    if run_id is None:
        return None
    with sessions() as s:
        run = s.get(BenchRun, run_id)
        return run.session_id if run else None


def _series_names(runs: list[RunResult]) -> dict[tuple[str, int | None], str]:
    """A series per target, or per target × slots where one target ran a level with several slot counts."""
    swept = {r.target for r in runs if len({x.slots for x in runs if x.target == r.target and x.level == r.level}) > 1}
    return {(r.target, r.slots): (f"{r.target} · {r.slots} slots" if r.target in swept else r.target) for r in runs}


def _charts(runs: list[RunResult]) -> dict:
    """{metric: {x: [levels], series: {name: [value per level]}, unit}} for the page's uPlot charts."""
    levels = sorted({r.level for r in runs})
    names = _series_names(runs)
    out = {}
    for metric, unit in CHART_METRICS.items():
        series: dict[str, list] = {}
        for (target, slots), name in names.items():
            by_level = {r.level: r.summary.get(metric) for r in runs if (r.target, r.slots) == (target, slots)}
            line = series.setdefault(name, [None] * len(levels))
            for i, lv in enumerate(levels):
                if by_level.get(lv) is not None:
                    line[i] = by_level[lv]
        out[metric] = {"x": levels, "series": series, "unit": unit}
    return out


def _overlap_view(traffic: dict, rare_share: float) -> dict:
    """The request log's overlap for the page: bars per bucket, bursts in words, the typical overlap."""
    bars = [{"bucket": name, "label": BUCKET_LABELS[name], "share": traffic["busy_shares"][name],
             "burst": low >= traffic["burst_overlap"]} for name, low in BUCKETS]
    top = max((b["share"] for b in bars), default=0.0)
    bursts = sorted(traffic["bursts"], key=lambda b: (-b["peak"], -b["requests"]))
    return {"t": traffic, "bars": bars, "top": top or 1.0, "rare": is_rare(traffic, rare_share),
            "bursts": [describe_burst(b) for b in bursts[:MAX_BURSTS_SHOWN]],
            "more_bursts": max(0, len(bursts) - MAX_BURSTS_SHOWN)}


def _session_context(s, session_id: int | None) -> dict:
    """One session (the given one, else the latest done) and the past-runs list, for their partials."""
    past = store.list_sessions(s)
    if session_id is None:
        session_id = next((p.id for p in past if p.status == "done"), None)
    current = s.get(BenchSession, session_id) if session_id is not None else None
    if session_id is not None and current is None:
        abort(404, description=f"no bench session {session_id}")
    runs = store.load_runs(s, session_id) if current else []
    return {"past": past, "current": current, "runs": runs, "charts": _charts(runs) if runs else None,
            "spec": spec_rows(runs), "applied": store.applied_history(s, limit=10), "scenarios": shipped_names()}


def _page_context(session_id: int | None) -> dict:
    from app.store.settings import all_settings

    with services().sessions() as s:
        ctx = _session_context(s, session_id)
        t = thresholds_from(all_settings(s))
        traffic = read_traffic(s, TRAFFIC_DAYS, burst_overlap=t.burst_overlap)
    return {**ctx, "overlap": _overlap_view(traffic, t.rare_overlap_share), "modes": MODES,
            "job": _jobs()["job"], "has_llama_server": _llama_server_path() is not None, "max_level": MAX_LEVEL,
            "voice_loop": voice_loop_view(services().data_dir)}


def voice_loop_view(data_dir) -> dict | None:
    """The last `hearth bench voice-loop` on this data folder, as stacked stages per phase (p50), or None."""
    path = data_dir / VOICE_LOOP_FILE
    try:
        figures = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    phases = []
    for phase in ("alone", "background"):
        stages = figures.get(phase) or {}
        parts = [(name, float(stages[name]["p50_ms"]), float(stages[name]["p95_ms"])) for name in VOICE_LOOP_STAGES
                 if name in stages]
        total = sum(p50 for _, p50, _ in parts) or 1.0
        phases.append({"name": phase, "total_p50_ms": (stages.get("speech_to_first_audio") or {}).get("p50_ms"),
                       "total_p95_ms": (stages.get("speech_to_first_audio") or {}).get("p95_ms"),
                       "stages": [{"name": n, "label": n.replace("_", " "), "p50_ms": p50, "p95_ms": p95,
                                   "share_pct": 100 * p50 / total} for n, p50, p95 in parts]})
    return {"phases": phases, "machine": figures.get("machine", ""), "at": figures.get("at", "")}


def _llama_server_path() -> str | None:
    """The stock llama-server's path when it is built, for the page's "compare with" option."""
    path = stock_llama_server()
    return str(path) if path else None


# Where `hearth bench voice-loop` leaves its last figures in the data folder, and its stages in order.
VOICE_LOOP_FILE = "bench/voice-loop.json"
VOICE_LOOP_STAGES = ("speech_to_transcript", "transcript_to_first_token", "first_token_to_first_sentence",
                     "first_sentence_to_first_audio")


@bp.get("/bench")
@login_required
def index():
    """The page: start form, live job, the selected (or latest) session's curves and verdict, past runs."""
    sid = request.args.get("session", type=int)
    return render_template("bench/index.html", **_page_context(sid))


@bp.post("/bench/start")
@login_required
def start():
    """Start a replay in the background with the household's default model."""
    jobs = _jobs()
    scenario = request.form.get("scenario", "household")
    if scenario not in shipped_names():
        abort(400, description=f"scenario: one of {', '.join(shipped_names())} (got {scenario!r})")
    levels = _counts(request.form.get("levels", "1,2,4,8"), "levels", MAX_LEVEL)
    slots_text = request.form.get("slots", "").strip()
    slots = _counts(slots_text, "slots", MAX_SLOTS) if slots_text else None
    modes = tuple(m for m in MODES if request.form.get(f"mode_{m}"))
    llama = _llama_server_path() if request.form.get("llama_server") else None
    if not modes and not llama:
        abort(400, description="choose at least one mode (or the stock llama-server) to measure")
    try:
        chosen = load_scenario(scenario)
    except ScenarioError as exc:
        abort(400, description=str(exc))
    spec, llama_spec = _spec_axis(request.form.get("spec", "").strip(), chosen.spec, chosen.llama_spec)
    svc = services()
    model = svc.catalog.default_model
    if model is None:
        abort(409, description="no default model to bench: set HEARTH_DEFAULT_MODEL or add a model")
    with svc.sessions() as s:
        from app.store.settings import get_setting

        threads = get_setting(s, "runner_threads")
    cfg = BenchConfig(scenario=scenario, levels=levels, modes=modes, model_path=str(model), llama_server=llama,
                      slots=slots, spec=spec, llama_spec=llama_spec if llama else (),
                      **({"threads": int(threads)} if threads else {}))
    with jobs["lock"]:
        job = jobs["job"]
        if job is not None and not job.finished:
            abort(409, description="a bench run is already in progress; wait for it to finish")
        jobs["job"] = job = BenchJob(scenario, total_runs(cfg, chosen))
    _start_thread(current_app._get_current_object(), cfg, job)
    if request.headers.get("HX-Request"):
        return render_template("bench/_progress.html", job=job)
    return redirect(url_for("bench.index"))


def _spec_axis(text: str, default: tuple[str, ...], llama_default: tuple[str, ...]) -> tuple[tuple, tuple]:
    """The form's speculation arms (empty: the scenario's; "none": no axis) and llama-server's, or a 400."""
    if not text:
        spec = default
    elif text == "none":
        spec = ()
    else:
        try:
            spec = parse_arms(text)
        except SpecAxisError as exc:
            abort(400, description=f"speculation: {exc}")
    return spec, ((llama_default or DEFAULT_LLAMA_SPEC) if spec else ())


@bp.get("/bench/progress")
@login_required
def progress():
    """The live progress partial; once the job is over, 286 (htmx stops polling) with the finished session swapped in."""
    job = _jobs()["job"]
    body = render_template("bench/_progress.html", job=job)
    if job is None:
        return body, STOP_POLLING
    if not job.finished:
        return body, 200
    if job.session_id is not None:
        # The last poll also replaces the session shown and the past runs, out of band, so the
        # page shows the session that just finished instead of the one it was opened on.
        with services().sessions() as s:
            ctx = _session_context(s, job.session_id)
        body += render_template("bench/_session.html", oob=True, **ctx)
        body += render_template("bench/_past.html", oob=True, **ctx)
    return body, STOP_POLLING


@bp.get("/bench/sessions/<int:session_id>/chart/<metric>.json")
@login_required
def chart(session_id: int, metric: str):
    """One metric against overlap level, a series per mode: {x, series, unit}."""
    if metric not in CHART_METRICS:
        abort(400, description=f"metric: one of {', '.join(CHART_METRICS)}")
    with services().sessions() as s:
        if s.get(BenchSession, session_id) is None:
            abort(404, description=f"no bench session {session_id}")
        runs = store.load_runs(s, session_id)
    return _charts(runs)[metric] if runs else {"x": [], "series": {}, "unit": CHART_METRICS[metric]}


@bp.get("/bench/sessions/<int:session_id>.json")
@login_required
def export_json(session_id: int):
    """The session as JSON: constants, verdict, summaries recomputed from raw rows, raw rows."""
    with services().sessions() as s:
        try:
            doc = store.session_document(s, session_id)
        except LookupError as exc:
            abort(404, description=str(exc))
    return Response(json.dumps(doc, indent=1, default=str), mimetype="application/json",
                    headers={"Content-Disposition": f"attachment; filename=bench-{session_id}.json"})


@bp.get("/bench/sessions/<int:session_id>.csv")
@login_required
def export_csv(session_id: int):
    """Every raw request of the session as CSV (one row per request)."""
    with services().sessions() as s:
        if s.get(BenchSession, session_id) is None:
            abort(404, description=f"no bench session {session_id}")
        runs = store.load_runs(s, session_id)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=["run_id", "target", "level", *store.REQUEST_FIELDS])
    w.writeheader()
    for r in runs:
        for req in r.requests:
            w.writerow({"run_id": r.run_id, "target": r.target, "level": r.level,
                        **{k: json.dumps(req[k]) if k == "server_timings" else req[k] for k in store.REQUEST_FIELDS}})
    return Response(buf.getvalue(), mimetype="text/csv",
                    headers={"Content-Disposition": f"attachment; filename=bench-{session_id}.csv"})


@bp.get("/bench/runs/<int:run_id>")
@login_required
def run_evidence(run_id: int):
    """The raw evidence of one run: every request's timings as the client saw them, and the samples."""
    with services().sessions() as s:
        run = s.get(BenchRun, run_id)
        if run is None:
            abort(404, description=f"no bench run {run_id}")
        session_id = run.session_id
        (result,) = [r for r in store.load_runs(s, session_id) if r.run_id == run_id]
    rows = [{**r, **request_times(r)} for r in result.requests]
    return render_template("bench/run.html", run=result, rows=rows, session_id=session_id)


@bp.post("/bench/sessions/<int:session_id>/apply/<int:index>")
@login_required
def apply(session_id: int, index: int):
    """Apply one recommendation: runner settings change now, recorded with who and when."""
    with services().write_sessions() as s:
        try:
            row = store.apply_recommendation(s, session_id, index, applied_by="admin")
        except store.ApplyError as exc:
            abort(400, description=str(exc))
        changes = ", ".join(f"{k} {before if before is not None else 'default'} → {after}"
                            for k, (before, after) in row.changes.items())
        model = row.model_name
        targets = "classes" in (row.recommendation.get("apply") or {})
    if targets:
        services().classes.invalidate()  # the gateway and the budget's targets take them at the next request
        flash(f"Applied class targets: {changes}. Requests from now on carry them.", "ok")
        return redirect(url_for("bench.index", session=session_id))
    # The catalog reads runner settings at its next rescan; do it now so the change is not silent.
    try:
        services().catalog.rescan()
    except OSError:
        pass
    flash(f"Applied to {model}: {changes}. Runners started from now on use it.", "ok")
    return redirect(url_for("bench.index", session=session_id))

