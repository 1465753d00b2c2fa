"""`/status`: one phone-sized page (390 px wide) saying whether Hearth is up and how loaded it is.

Viewable without the admin login only when the `status_public` setting is on (off by default).
"""

from __future__ import annotations

import functools

from flask import Blueprint, render_template

from app.device_probe import peek_probe, probe_in_background
from app.gateway.context import services
from app.residency.manager import ModelState
from app.web.auth import login_required
from app.web.overview import has_gpu, live_state

bp = Blueprint("status", __name__)

# A sample older than this means the sampler (or the whole process) is stuck.
STALE_SAMPLE_S = 10


def public_or_login(view):
    """Open to anyone when status_public is on, else the admin login applies."""
    guarded = login_required(view)

    @functools.wraps(view)
    def wrapped(*args, **kwargs):
        if services().settings.get("status_public"):
            return view(*args, **kwargs)
        return guarded(*args, **kwargs)

    return wrapped


def _context() -> dict:
    svc = services()
    live = live_state(svc)
    failed = [m for m in live.models if m["state"] == ModelState.FAILED]
    if live.sample_age_s is not None and live.sample_age_s > STALE_SAMPLE_S:
        health, health_text = "warn", "Degraded: telemetry stalled"
    elif failed:
        health, health_text = "warn", "Up, " + ", ".join(m["name"] for m in failed) + " failed"
    else:
        health, health_text = "ok", "Up"
    # The devices llama.cpp sees, read once in a child process (never on the request's own time).
    probe_in_background()
    return {"live": live, "gpu": has_gpu(svc, live), "health": health, "health_text": health_text,
            "public": bool(svc.settings.get("status_public")), "probe": peek_probe()}


@bp.get("/status")
@public_or_login
def index():
    """The status page."""
    return render_template("status/index.html", **_context())


@bp.get("/partials/status")
@public_or_login
def card():
    """The status content, polled every 2 s."""
    return render_template("status/_status.html", **_context())
