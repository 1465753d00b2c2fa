"""The default model's first-run assembly, as a banner every page shows while it lasts.

Open without the login: it reveals only how far the embedded model is, and the first-run /setup
page (no admin exists yet) must show it too.
"""

from __future__ import annotations

from flask import Blueprint, render_template

from app.gateway.context import services

bp = Blueprint("progress", __name__)

# htmx stops polling an element whose request answers 286.
STOP_POLLING = 286


def _progress() -> dict | None:
    return services().catalog.default_model_progress()


@bp.app_context_processor
def _banner():
    return {"default_model_progress": _progress}


@bp.get("/partials/default-model")
def default_model():
    """The progress banner, polled every second; 286 (stop) once the model is ready or has failed."""
    progress = _progress()
    html = render_template("_default_model_progress.html", model_progress=progress, model_ready=progress is None)
    if progress is None or progress["error"]:
        return html, STOP_POLLING
    return html
