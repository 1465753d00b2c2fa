"""The Preload page: when each model is wanted (heat strips from the request log), the recommended schedule, Apply.

Everything on it is read from the store (app.services.preload): the profile and the recommendation are computed
when the page is asked for, in the box's local time (the preload job's zone and clock, so page and job agree).
Apply sends back the lines the admin saw; when the recommendation has changed since (new requests, a new cold
start), nothing is stored and the page says to look again. The schedule acts through the preload_models job.
"""

from __future__ import annotations

from flask import Blueprint, abort, flash, redirect, render_template, request, url_for

from app.gateway.context import services
from app.services.preload import (
    DAYS_WORDS,
    DEFAULT_LOOKBACK_DAYS,
    MAX_LOOKBACK_DAYS,
    MIN_DAYS_OF_DATA,
    MIN_LOOKBACK_DAYS,
    MIN_SHARE,
    SLOT_MIN,
    SLOTS_PER_DAY,
    PreloadError,
    apply_schedule,
    check_lookback,
    hhmm,
    recommend,
    remove_entry,
    schedule,
)
from app.services.settings import budget_bytes
from app.web.auth import login_required

bp = Blueprint("preload", __name__)


def _lookback(raw: str | None) -> int:
    """The lookback asked for (days), or a 400 that says the bounds."""
    if raw is None or raw == "":
        return DEFAULT_LOOKBACK_DAYS
    try:
        return check_lookback(int(raw))
    except ValueError as exc:
        reason = str(exc) if isinstance(exc, PreloadError) else f"{raw!r} is not a whole number of days"
        abort(400, description=f"Lookback: {reason}; e.g. ?days={DEFAULT_LOOKBACK_DAYS}")


def _recommendation(days: int):
    svc = services()
    with svc.sessions() as s:
        rec = recommend(s, svc.catalog.model_specs(), budget_bytes(svc.settings), svc.preload.clock(), days,
                        svc.preload.tz)
        applied = schedule(s)
        s.expunge_all()
    return rec, applied


@bp.get("/preload")
@login_required
def index():
    """The time-of-day profile, the recommended schedule with its evidence, and the applied schedule."""
    days = _lookback(request.args.get("days"))
    rec, applied = _recommendation(days)
    ticks = [(h * 60 // SLOT_MIN, f"{h:02d}") for h in range(0, 24, 3)]
    return render_template("preload/index.html", rec=rec, applied=applied, days=days, outcomes=list(services().preload.outcomes),
                           hhmm=hhmm, days_words=DAYS_WORDS, slots=SLOTS_PER_DAY, slot_min=SLOT_MIN, ticks=ticks,
                           min_share=MIN_SHARE, min_days=MIN_DAYS_OF_DATA, min_lookback=MIN_LOOKBACK_DAYS,
                           max_lookback=MAX_LOOKBACK_DAYS)


@bp.post("/preload/apply")
@login_required
def apply():
    """Replace the schedule with the recommendation the admin saw: all of it, or nothing when it changed."""
    days = _lookback(request.form.get("days"))
    shown = request.form.getlist("entry")
    rec, _ = _recommendation(days)
    now = [line.key for line in rec.applicable]
    if sorted(shown) != sorted(now):
        gone = sorted(set(shown) - set(now))
        new = sorted(set(now) - set(shown))
        detail = "; ".join(part for part in (
            f"no longer recommended: {', '.join(gone)}" if gone else "",
            f"newly recommended: {', '.join(new)}" if new else "") if part)
        abort(409, description=f"The recommendation changed since the page was shown ({detail or 'its order'}); "
                               "nothing was applied. Reload the Preload page and look at it again.")
    svc = services()
    with svc.write_sessions() as s:
        try:
            rows = apply_schedule(s, rec.applicable, svc.catalog.model_specs(), applied_by="admin")
        except PreloadError as exc:
            abort(400, description=str(exc))
        s.commit()
        summary = ", ".join(f"{r.model_name} at {hhmm(r.at_minute)} on {r.days}" for r in rows)
    flash(f"Preload schedule applied: {summary}. The preload job loads each at its time.", "ok")
    return redirect(url_for("preload.index", days=days))


@bp.post("/preload/<int:entry_id>/remove")
@login_required
def remove(entry_id: int):
    """Remove one entry of the applied schedule."""
    with services().write_sessions() as s:
        try:
            row = remove_entry(s, entry_id)
        except PreloadError as exc:
            abort(404, description=str(exc))
        s.commit()
        flash(f"Removed: {row.model_name} at {hhmm(row.at_minute)} on {row.days}.", "ok")
    return redirect(url_for("preload.index", days=request.form.get("days") or DEFAULT_LOOKBACK_DAYS))
