"""The Flask application factory of `hearth serve`."""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from functools import partial
from pathlib import Path

from apscheduler.schedulers.background import BackgroundScheduler
from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound

from app.gateway.context import Services, install, services
from app.gateway.cors import install_cors, install_host_check
from app.gateway.wiring import build_services
from app.protocols.openai import ApiError
from app.residency.manager import ResidencyManager

log = logging.getLogger(__name__)
# Where the app keeps its scheduler and its shutdown (the old key stays: tests and tools call it).
_SCHEDULER = "scheduler"
_SHUTDOWN = "hearth_shutdown"


# The API prefixes whose errors are JSON in OpenAI's shape, whatever the client accepts.
_API_PREFIXES = ("/v1", "/api")


def _is_api_path(path: str) -> bool:
    return path == "/healthz" or any(path == p or path.startswith(p + "/") for p in _API_PREFIXES)


def _json_error(exc: HTTPException) -> Response:
    headers = {}
    if isinstance(exc, NotFound):
        # OpenAI's own words for a path it does not serve.
        listed = "; the endpoints are listed in /v1/openapi.json" if request.path.startswith("/v1") else ""
        err = ApiError(404, f"Invalid URL ({request.method} {request.path}): no such endpoint{listed}", code="unknown_url")
    elif isinstance(exc, MethodNotAllowed):
        allowed = sorted(set(exc.valid_methods or ()) - {"HEAD", "OPTIONS"})
        headers["Allow"] = ", ".join(exc.valid_methods or ())
        err = ApiError(405, f"{request.method} is not allowed on {request.path}; use {' or '.join(allowed)}",
                       code="method_not_allowed")
    else:
        err = ApiError(exc.code or 500, exc.description or exc.name)
    return Response(json.dumps(err.body()), status=err.status, mimetype="application/json", headers=headers)


# No other site may frame a page of serve's (clickjacking the admin into pressing Unload, say):
# CSP's frame-ancestors for current browsers, X-Frame-Options for older ones; nosniff so an
# answer is never run as another type than the one it says.
SECURITY_HEADERS = {
    "Content-Security-Policy": "frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
}


def _security_headers(resp: Response) -> Response:
    for name, value in SECURITY_HEADERS.items():
        resp.headers.setdefault(name, value)
    return resp


def _start_pinned(residency: ResidencyManager) -> None:
    started = residency.start_pinned()
    if started:
        log.info("pinned models: %s", started)


def _start_wyoming(app: Flask, svc: Services):
    """The Wyoming speech-to-text listener, where its port is set (app.gateway.wyoming); None: off."""
    port = int(svc.settings.get("wyoming_port") or 0)
    if not port:
        return None
    from app.gateway.wyoming import WyomingServer

    try:
        return WyomingServer(app, str(svc.settings.get("wyoming_bind") or "0.0.0.0"), port).start()
    except OSError as exc:
        log.error("wyoming: cannot listen on port %d: %s (serve goes on without it)", port, exc)
        return None


def schedule_jobs(scheduler: BackgroundScheduler, svc: Services, rescan_s: int) -> None:
    """Add serve's jobs: each one bound method of the service it acts on, under an explicit id."""
    jobs = (
        ("expire_models", svc.residency.expire_idle, {"seconds": 5}),
        ("check_nodes", svc.residency.check_nodes, {"seconds": 5}),
        ("rescan_catalog", svc.catalog.rescan, {"seconds": rescan_s}),
        ("sample_telemetry", svc.sampler.sample_all, {"seconds": 1}),
        ("rollup_samples", svc.rollups.rollup_samples, {"seconds": 60}),
        ("prune_samples", svc.rollups.prune_samples, {"hours": 1}),
        ("prune_requests", svc.rollups.prune_requests, {"hours": 1}),
        ("flush_refusals", svc.refusals.flush, {"seconds": 10}),
        ("size_targets", svc.targets.run, {"seconds": 15}),
        ("check_weights", svc.warmer.check, {"seconds": 60}),
        ("preload_models", svc.preload.run, {"minutes": 1}),
        ("expire_kv_cache", svc.catalog.expire_kv_cache, {"hours": 1}),
    )
    if svc.speech is not None:
        jobs += (("expire_speech", svc.speech.expire_idle, {"seconds": 5}),)
    for job_id, job, every in jobs:
        scheduler.add_job(job, "interval", id=job_id, **every)


def create_app(test_config: dict | None = None) -> Flask:
    """Build the app: store (migrated), catalog, residency, gateway, jobs."""
    from app import web
    from app.gateway.api import bp as gateway_bp
    from app.gateway.audio import bp as audio_bp
    from app.gateway.ollama import bp as ollama_bp
    from app.gateway.vendors import bp as vendors_bp
    from app.paths import data_dir
    from app.residency.default_model import verified_default_model
    from app.store.db import hold_store, open_store

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
    # Held while this app serves the store: `hearth restore` refuses to swap it underneath.
    store_lock = hold_store(data)
    engine, sessions = open_store(data)
    svc = build_services(data, engine, sessions, default_model, app.config["HEARTH_MODELS_DIR"])
    install(app, svc)
    if default_model is None:
        svc.catalog.assemble_default_model(after_ready=partial(_start_pinned, svc.residency))
    app.register_blueprint(gateway_bp)
    app.register_blueprint(ollama_bp)
    app.register_blueprint(vendors_bp)
    app.register_blueprint(audio_bp)
    install_host_check(app)
    install_cors(app)
    web.init_app(app)
    app.after_request(_security_headers)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        if _is_api_path(request.path):
            return _json_error(exc)
        if web.wants_html():
            return web.render_error(exc)
        return exc

    if app.config["SCHEDULER"]:
        scheduler = _scheduler_class()(job_defaults={"coalesce": True, "max_instances": 1})
        schedule_jobs(scheduler, svc, int(svc.settings.get("rescan_interval_s")))
        scheduler.start()
        app.extensions[_SCHEDULER] = scheduler
        wyoming = _start_wyoming(app, svc)
    _start_pinned(svc.residency)

    shutdown_lock = threading.Lock()
    shut_down = []

    def shutdown():
        # Called at SIGTERM's drain deadline (app.serve) and again at exit: the first call stops
        # everything, a concurrent or later one waits for it and returns.
        with shutdown_lock:
            if shut_down:
                return
            sched = app.extensions.pop(_SCHEDULER, None)
            if sched is not None:
                sched.shutdown(wait=False)
                if wyoming is not None:
                    wyoming.stop()
            svc.shutdown()
            store_lock.close()
            shut_down.append(True)

    app.extensions[_SHUTDOWN] = shutdown
    atexit.register(shutdown)
    return app


def browser_url(bind: str) -> str:
    """The address to type for a gunicorn bind ("0.0.0.0:8080" → this machine, from the machine itself)."""
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        return f"http://localhost:{port}"
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def listening_lines(data_dir: Path, binds: list[str]) -> list[str]:
    """What serve's log says once it listens: which URL to open, and the setup code while no admin exists."""
    from app.web.auth import pending_setup_code, setup_code_path

    urls = [browser_url(b) for b in binds if not b.startswith(("unix:", "fd://"))]
    if not urls:
        return [f"listening on {', '.join(binds)}"]
    url = urls[0]
    wildcard = any(b.rpartition(":")[0].strip("[]") in ("", "0.0.0.0", "::") for b in binds)
    elsewhere = " (from another device: this machine's address on your network instead of localhost)" if wildcard else ""
    lines = [f"listening: the dashboard is at {url}/ and the OpenAI API at {url}/v1{elsewhere}"]
    code = pending_setup_code(data_dir, log_new=False)
    if code is not None:
        lines.append(f"first run: open {url}/setup in a browser and enter the setup code {code} "
                     f"(also kept in {setup_code_path(data_dir)} until the admin password is set)")
    return lines


def announce_listening(app: Flask, binds: list[str]) -> None:
    """Write listening_lines to serve's log, whatever the log level (a newcomer must see where to go)."""
    from app.gateway.lan import startup_warnings
    from app.residency.default_model import log_line

    for line in listening_lines(services(app).data_dir, binds):
        log_line(line)
    settings = services(app).settings
    for warning in startup_warnings(bool(settings.get("api_open_on_lan")), binds, int(settings.get("proxy_hops") or 0)):
        log.warning("LAN-open mode: %s", warning)


def _scheduler_class() -> type[BackgroundScheduler]:
    """APScheduler's gevent scheduler under serve's gevent worker, its thread scheduler elsewhere.

    Under gevent's patching, joining BackgroundScheduler's thread at shutdown never returns (its
    thread-state lock is never released), so SIGTERM's drain would hang before stopping the runners.
    """
    import sys

    if "gevent" in sys.modules:
        from gevent import monkey

        if monkey.is_module_patched("threading"):
            from apscheduler.schedulers.gevent import GeventScheduler

            return GeventScheduler
    return BackgroundScheduler


def scheduler_of(app: Flask) -> BackgroundScheduler | None:
    """The app's running job scheduler (None when built with SCHEDULER=False, or after shutdown)."""
    return app.extensions.get(_SCHEDULER)


def shutdown_app(app: Flask) -> None:
    """Stop the app's jobs, runners and store writer; idempotent, safe from any thread."""
    app.extensions[_SHUTDOWN]()
