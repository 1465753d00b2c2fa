"""`hearth serve`: the Flask app under gunicorn with exactly ONE worker and threads.

APScheduler jobs and the runner supervisor live inside the app, so a second worker would
run every job twice and start a second copy of every model: the config refuses it.
"""

from __future__ import annotations

import os
import signal
import threading

from gunicorn.app.base import BaseApplication

from app.engine.runner import no_delay

DEFAULT_BIND = "127.0.0.1:8080"
DEFAULT_THREADS = 32
# On SIGTERM the arbiter SIGKILLs the worker GRACEFUL_TIMEOUT_S later, and a killed worker stops no
# runner. So answers in flight get DRAIN_S to finish, then the runners are stopped (in parallel,
# each SIGKILLed by the supervisor if not gone in 10 s) while the worker still lives: 8 + 10 < 25.
# Docker's stop_grace_period (30 s in docker-compose.yml) covers the whole sequence.
GRACEFUL_TIMEOUT_S = 25
DRAIN_S = 8.0


class ConfigError(ValueError):
    """A gunicorn setting Hearth cannot run with."""


def gunicorn_settings(bind: str, threads: int = DEFAULT_THREADS, workers: int = 1) -> dict:
    """The gunicorn settings for `hearth serve`; refuses more than one worker."""
    if workers != 1:
        raise ConfigError(
            f"hearth serve must run exactly one gunicorn worker (got {workers}): the scheduler and the "
            "model runners live in the worker; use --threads for concurrency"
        )
    if threads < 4:
        raise ConfigError(f"hearth serve needs at least 4 threads (got {threads})")
    return {
        "bind": bind,
        "workers": 1,
        "worker_class": "gthread",
        "threads": threads,
        "timeout": 120,
        "graceful_timeout": GRACEFUL_TIMEOUT_S,
        "keepalive": 5,
        "accesslog": None,
        "errorlog": "-",
        "loglevel": "warning",
        "preload_app": False,
        "proc_name": "hearth-serve",
        "when_ready": no_delay,
        "post_worker_init": worker_ready,
    }


def worker_ready(worker) -> None:
    """Worker hook: the app is loaded and the socket listens: say where to go, then arm the drain."""
    from app.factory import announce_listening

    announce_listening(worker.wsgi, worker.cfg.bind)
    stop_runners_after_drain(worker)


def stop_runners_after_drain(worker) -> None:
    """Worker hook: after SIGTERM, stop the app (runners, store) once DRAIN_S have passed."""
    from app.factory import shutdown_app

    gunicorn_handler = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        gunicorn_handler(signum, frame)  # stop accepting; requests in flight go on
        # Runs only if the worker is still draining then: a worker that finishes earlier
        # exits and stops everything through the same (idempotent) shutdown at exit.
        timer = threading.Timer(DRAIN_S, shutdown_app, args=[worker.wsgi])
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_sigterm)


class HearthServer(BaseApplication):
    """Gunicorn running create_app() in its single worker."""

    def __init__(self, settings: dict, app_factory):
        self.settings = settings
        self.app_factory = app_factory
        super().__init__()

    def load_config(self):
        for key, value in self.settings.items():
            self.cfg.set(key, value)
        # Gunicorn reads WEB_CONCURRENCY and GUNICORN_CMD_ARGS too: check what it finally got.
        if self.cfg.workers != 1:
            raise ConfigError(f"hearth serve must run exactly one gunicorn worker, not {self.cfg.workers}")

    def load(self):
        return self.app_factory()


def stored_bind() -> str | None:
    """The bind address saved on the Settings page, if any."""
    from app.paths import data_dir
    from app.store.db import open_store
    from app.store.settings import get_setting

    engine, sessions = open_store(data_dir())
    try:
        with sessions() as s:
            return get_setting(s, "bind")
    finally:
        engine.dispose()


def serve(bind: str | None = None, threads: int = DEFAULT_THREADS) -> None:
    """Run Hearth until interrupted."""
    from app.factory import create_app

    # The default model is not assembled here: on a first run the worker assembles it in the
    # background, so the dashboard is reachable at once and shows the progress (the log too).
    bind = bind or os.environ.get("HEARTH_BIND") or stored_bind() or DEFAULT_BIND
    HearthServer(gunicorn_settings(bind, threads), create_app).run()
