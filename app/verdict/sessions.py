"""Bench sessions in the store: runs with their raw per-request rows, summaries recomputed from them, Apply."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.gateway.classes import policy_of
from app.policy import ClassPolicy
from app.store.models import (
    BenchApplied,
    BenchRequest,
    BenchRun,
    BenchSession,
    Model,
    RequestClass,
    RunnerSettings,
    utcnow,
)
from app.verdict.results import RunResult, as_evidence, summarise, summary_rows

REQUEST_FIELDS = ("idx", "class_name", "priority", "sent_s", "first_token_s", "end_s", "prompt_tokens",
                  "completion_tokens", "max_tokens", "status", "error", "server_timings")
# What Apply may change on a model's runner settings.
RUNNER_FIELDS = ("mode", "parallel", "n_batch", "speculation")


class ApplyError(ValueError):
    """A recommendation that cannot be applied; the message says why."""


def policies(session: Session) -> dict[str, ClassPolicy]:
    """The stored class policies by name."""
    return {r.name: policy_of(r) for r in session.scalars(select(RequestClass))}


def create_session(session: Session, scenario: str, model_name: str | None, constants: dict) -> int:
    """A new bench session row in state 'running'; returns its id. Commits."""
    row = BenchSession(scenario=scenario, model_name=model_name, constants=constants, status="running")
    session.add(row)
    session.commit()
    return row.id


def save_run(session: Session, session_id: int, run: RunResult) -> int:
    """One run with every request's raw row; sets run.run_id. Commits."""
    # target is the run's label (with its speculation arm, app.verdict.spec); mode the target without it.
    row = BenchRun(session_id=session_id, target=run.target, mode=run.base, level=run.level, slots=run.slots,
                   wall_s=run.summary["wall_s"], samples=run.samples, summary=run.summary)
    session.add(row)
    session.flush()
    for r in run.requests:
        session.add(BenchRequest(run_id=row.id, **{k: r[k] for k in REQUEST_FIELDS}))
    session.commit()
    run.run_id = row.id
    return row.id


def save_summary(session: Session, run: RunResult) -> None:
    """Store a saved run's summary again (notes added after it ran: the near-ties of its outputs). Commits."""
    row = session.get(BenchRun, run.run_id)
    row.summary = dict(run.summary)
    session.commit()


def finish_session(session: Session, session_id: int, verdict: dict | None, error: str | None = None) -> None:
    """Mark the session done (or failed) and keep its verdict. Commits."""
    row = session.get(BenchSession, session_id)
    row.status = "failed" if error else "done"
    row.error = error
    row.verdict = verdict
    row.finished_at = utcnow()
    session.commit()


def raw_requests(session: Session, run_id: int) -> list[dict]:
    """The raw rows of one run, as the replay client recorded them."""
    rows = session.scalars(select(BenchRequest).where(BenchRequest.run_id == run_id).order_by(BenchRequest.idx))
    return [{k: getattr(r, k) for k in REQUEST_FIELDS} for r in rows]


def load_runs(session: Session, session_id: int, class_policies: dict[str, ClassPolicy] | None = None,
              recompute: bool = True) -> list[RunResult]:
    """A session's runs from the store; summaries recomputed from the raw rows unless told otherwise."""
    if class_policies is None:
        # The policies the run was judged by (kept with its constants), else today's.
        kept = (session.get(BenchSession, session_id).constants or {}).get("classes")
        class_policies = {n: ClassPolicy(**p) for n, p in kept.items()} if kept else policies(session)
    out = []
    seen: dict[tuple[str, int, int | None], int] = {}
    for row in session.scalars(select(BenchRun).where(BenchRun.session_id == session_id).order_by(BenchRun.id)):
        reqs = raw_requests(session, row.id)
        # Each request's output text is kept in the run's summary (no column for it): back on its row.
        outputs = (row.summary or {}).get("outputs") or {}
        for r in reqs:
            if str(r["idx"]) in outputs:
                r["output"] = outputs[str(r["idx"])]
        # Repetitions of a target × level × slots were stored in order: the n-th one is repetition n.
        key = (row.target, row.level, row.slots)
        rep = seen.get(key, 0)
        seen[key] = rep + 1
        run = RunResult(row.target, "", row.level, reqs, list(row.samples or []), run_id=row.id, rep=rep,
                        slots=row.slots)
        run.summary = summarise(reqs, run.samples, class_policies) if recompute else dict(row.summary)
        out.append(run)
    return out


def evidence(results: list[RunResult]) -> list[dict]:
    """Run summaries in the shape app.verdict.decide reads (app.verdict.results.as_evidence)."""
    return as_evidence(results)


def list_sessions(session: Session, limit: int = 20) -> list[BenchSession]:
    """The latest bench sessions, newest first."""
    return list(session.scalars(select(BenchSession).order_by(BenchSession.id.desc()).limit(limit)))


def session_document(session: Session, session_id: int) -> dict:
    """Everything about one session for JSON export: constants, verdict, summaries and raw rows."""
    s = session.get(BenchSession, session_id)
    if s is None:
        raise LookupError(f"no bench session {session_id}")
    runs = load_runs(session, session_id)
    return document(s.scenario, s.constants, s.verdict, runs, session_id=session_id)


def document(scenario: str, constants: dict, verdict: dict | None, runs: list[RunResult],
             session_id: int | None = None) -> dict:
    """The JSON document: summaries per mode × level, the verdict with its reasons, constants, raw rows."""
    return {
        "session_id": session_id,
        "scenario": scenario,
        "constants": constants,
        "verdict": verdict,
        "summaries": [{"run_id": r.run_id, "mode": r.target, "level": r.level, "slots": r.slots, "summary": r.summary}
                      for r in runs],
        "raw": [{"run_id": r.run_id, "mode": r.target, "level": r.level, "slots": r.slots, "requests": r.requests,
                 "samples": r.samples} for r in runs],
    }


def write_json(doc: dict, path: str | Path) -> None:
    """Write the session document."""
    Path(path).write_text(json.dumps(doc, indent=1, default=str))


def write_csv(runs: list[RunResult], path: str | Path) -> Path:
    """Summaries (one row per mode × level) to `path`; raw request rows beside it (*-requests.csv)."""
    path = Path(path)
    rows = summary_rows(runs)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["target"])
        w.writeheader()
        w.writerows(rows)
    raw_path = path.with_name(path.stem + "-requests" + (path.suffix or ".csv"))
    with raw_path.open("w", newline="") as f:
        fields = ["run_id", "target", "level", "slots", *REQUEST_FIELDS]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in runs:
            for req in r.requests:
                w.writerow({"run_id": r.run_id, "target": r.target, "level": r.level, "slots": r.slots,
                            **{k: (json.dumps(req[k]) if k == "server_timings" else req[k]) for k in REQUEST_FIELDS}})
    return raw_path


def current_runner_settings(session: Session, model_name: str | None) -> dict:
    """The model's runner settings as the verdict reads them (stored row, else the defaults; speculation when set)."""
    from app.residency.estimate import AUTO_SLOTS_CPU
    from app.store.settings import get_setting

    # No stored default: the catalog sizes the slots (size_runner); its target is what a roomy box gets.
    out = {"parallel": get_setting(session, "runner_parallel") or AUTO_SLOTS_CPU,
           "n_batch": get_setting(session, "runner_batch"), "mode": "continuous"}
    model = session.scalar(select(Model).where(Model.name == model_name)) if model_name else None
    rs = session.scalar(select(RunnerSettings).where(RunnerSettings.model_id == model.id)) if model else None
    if rs is not None:
        out.update({k: v for k, v in (("parallel", rs.parallel), ("n_batch", rs.n_batch), ("mode", rs.mode),
                                      ("speculation", rs.speculation)) if v is not None})
    return out


def apply_recommendation(session: Session, session_id: int, index: int, applied_by: str) -> BenchApplied:
    """Apply recommendation `index` of a session's verdict: update the model's settings, record who did what."""
    s = session.get(BenchSession, session_id)
    if s is None or not s.verdict:
        raise ApplyError(f"bench session {session_id} has no verdict")
    recs = s.verdict.get("recommendations", [])
    if not 0 <= index < len(recs):
        raise ApplyError(f"bench session {session_id} has no recommendation {index}")
    rec = recs[index]
    change = rec.get("apply")
    if not change:
        raise ApplyError(f"recommendation {index} ({rec['kind']}) changes nothing: it is advice only")
    if "classes" in change:
        return _apply_class_targets(session, s, rec, change["classes"], applied_by)
    model_name = change.get("model") or s.model_name
    model = session.scalar(select(Model).where(Model.name == model_name))
    if model is None:
        raise ApplyError(f"model {model_name!r} is not in the catalog yet: start hearth serve once so it is scanned")
    changes: dict[str, list] = {}
    if "policy" in change:
        changes["policy"] = [model.policy, change["policy"]]
        model.policy = change["policy"]
    fields = {k: v for k, v in change.items() if k in RUNNER_FIELDS}
    if fields:
        rs = session.scalar(select(RunnerSettings).where(RunnerSettings.model_id == model.id))
        if rs is None:
            rs = RunnerSettings(model_id=model.id, kind="hearth")
            session.add(rs)
        for k, v in fields.items():
            changes[k] = [getattr(rs, k), v]
            setattr(rs, k, v)
    row = BenchApplied(applied_by=applied_by, session_id=session_id, model_name=model_name, recommendation=rec,
                       changes=changes)
    session.add(row)
    session.commit()
    return row


CLASS_TARGET_FIELDS = ("ttft_target_ms", "tpot_target_ms")


def _apply_class_targets(session: Session, s: BenchSession, rec: dict, targets: dict, applied_by: str) -> BenchApplied:
    """Write a "targets" recommendation's per-class targets; every class must exist and every value be ≥ 1 ms."""
    changes: dict[str, list] = {}
    writes = []
    for name, values in sorted(targets.items()):
        row = session.get(RequestClass, name)
        if row is None:
            raise ApplyError(f"class {name!r} no longer exists: run the bench again for targets of today's classes")
        for field, value in values.items():
            if field not in CLASS_TARGET_FIELDS or isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ApplyError(f"{name}.{field} = {value!r} is not a target in whole milliseconds")
            changes[f"{name}.{field}"] = [getattr(row, field), value]
            writes.append((row, field, value))
    for row, field, value in writes:  # only once every value passed: all or nothing
        setattr(row, field, value)
    row = BenchApplied(applied_by=applied_by, session_id=s.id, model_name=s.model_name, recommendation=rec,
                       changes=changes)
    session.add(row)
    session.commit()
    return row


def applied_history(session: Session, limit: int = 20) -> list[BenchApplied]:
    """The latest applied recommendations, newest first."""
    return list(session.scalars(select(BenchApplied).order_by(BenchApplied.id.desc()).limit(limit)))
