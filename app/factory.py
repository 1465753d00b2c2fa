"""The Flask application factory of `hearth serve`."""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from pathlib import Path

from apscheduler.schedulers.background import BackgroundScheduler
from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from app.engine.api import ApiError

log = logging.getLogger(__name__)


def _json_error(exc: HTTPException) -> Response:
    err = ApiError(exc.code or 500, exc.description or exc.name)
    return Response(json.dumps(err.body()), status=err.status, mimetype="application/json")


def create_app(test_config: dict | None = None) -> Flask:
    """Build the app: store (migrated), catalog, residency, gateway, jobs."""
    from app import web
    from app.gateway.api import bp as gateway_bp
    from app.gateway.ollama import bp as ollama_bp
    from app.paths import data_dir
    from app.residency.default_model import verified_default_model
    from app.services import Hearth
    from app.store.db import open_store
    from app.store.settings import get_setting

    app = Flask(__name__, instance_relative_config=False, template_folder=web.TEMPLATES_DIR,
                static_folder=web.STATIC_DIR)
    app.config.update(
        HEARTH_DATA=os.environ.get("HEARTH_DATA"),
        HEARTH_MODELS_DIR=os.environ.get("HEARTH_MODELS_DIR"),
        # A GGUF to use as the embedded default instead of assembling it (tests share one copy).
        HEARTH_DEFAULT_MODEL=os.environ.get("HEARTH_DEFAULT_MODEL"),
        MAX_CONTENT_LENGTH=4 * 1024 * 1024,
        SCHEDULER=True,
    )
    if test_config:
        app.config.update(test_config)
    data = Path(app.config["HEARTH_DATA"]).expanduser() if app.config["HEARTH_DATA"] else data_dir()
    data.mkdir(parents=True, exist_ok=True)
    # Already verified (every start but the first): used at once. Otherwise it is assembled in the
    # background below, so the dashboard is up and can show the progress.
    default_model = (Path(app.config["HEARTH_DEFAULT_MODEL"]) if app.config["HEARTH_DEFAULT_MODEL"]
                     else verified_default_model(data))
    engine, sessions = open_store(data)
    # $HEARTH_MODELS_DIR wins over the folder stored on the Settings page, which wins over <data>/models.
    with sessions() as s:
        stored_models_dir = get_setting(s, "models_dir")
    models_dir = Path(app.config["HEARTH_MODELS_DIR"] or stored_models_dir or data / "models").expanduser()
    models_dir.mkdir(parents=True, exist_ok=True)
    hearth = Hearth(data, models_dir, default_model, engine, sessions)
    app.extensions["hearth"] = hearth
    if default_model is None:
        hearth.assemble_default_model()
    app.register_blueprint(gateway_bp)
    app.register_blueprint(ollama_bp)
    web.init_app(app)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        if request.path.startswith(("/v1/", "/api/")) or request.path == "/healthz":
            return _json_error(exc)
        if web.wants_html():
            return web.render_error(exc)
        return exc

    if app.config["SCHEDULER"]:
        with sessions() as s:
            rescan_s = int(get_setting(s, "rescan_interval_s"))
        scheduler = BackgroundScheduler(daemon=True, job_defaults={"coalesce": True, "max_instances": 1})
        scheduler.add_job(hearth.residency.expire_idle, "interval", seconds=5, id="expire_models")
        scheduler.add_job(hearth.residency.check_nodes, "interval", seconds=5, id="check_nodes")
        scheduler.add_job(hearth.rescan, "interval", seconds=rescan_s, id="rescan_catalog")
        scheduler.add_job("app.telemetry.sampler:sample_all", "interval", seconds=1, args=[hearth], id="sample_telemetry")
        scheduler.add_job("app.telemetry.rollup:rollup_samples", "interval", seconds=60, args=[hearth], id="rollup_samples")
        scheduler.add_job("app.telemetry.rollup:prune_samples", "interval", hours=1, args=[hearth], id="prune_samples")
        scheduler.start()
        app.extensions["scheduler"] = scheduler
    started = hearth.residency.start_pinned()
    if started:
        log.info("pinned models: %s", started)

    shutdown_lock = threading.Lock()
    shut_down = []

    def shutdown():
        # Called at SIGTERM's drain deadline (app.serve) and again at exit: the first call stops
        # everything, a concurrent or later one waits for it and returns.
        with shutdown_lock:
            if shut_down:
                return
            sched = app.extensions.pop("scheduler", None)
            if sched is not None:
                sched.shutdown(wait=False)
            hearth.shutdown()
            shut_down.append(True)

    app.extensions["hearth_shutdown"] = shutdown
    atexit.register(shutdown)
    return app
