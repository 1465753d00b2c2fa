"""`hearth runner`: one model served over loopback HTTP by gunicorn (one worker, threads)."""

from __future__ import annotations

import logging

from gunicorn.app.base import BaseApplication

from app.engine.server import RunnerConfig, create_app

log = logging.getLogger(__name__)


class RunnerServer(BaseApplication):
    """Gunicorn with exactly one gthread worker: the engine and its KV cache live in that one process."""

    def __init__(self, config: RunnerConfig, host: str, port: int, http_threads: int):
        self.config = config
        self.bind = f"{host}:{port}"
        self.http_threads = http_threads
        super().__init__()

    def load_config(self):
        settings = {
            "bind": self.bind,
            "workers": 1,
            "worker_class": "gthread",
            "threads": self.http_threads,
            # Generation can stream for minutes; the gthread worker heartbeats from its own loop.
            "timeout": 120,
            "graceful_timeout": 10,
            "keepalive": 5,
            "accesslog": None,
            "errorlog": "-",
            "loglevel": "warning",
            "preload_app": False,
            "proc_name": "hearth-runner",
        }
        for key, value in settings.items():
            self.cfg.set(key, value)

    def load(self):
        # Runs in the worker after fork: the model and the engine thread belong to the worker.
        return create_app(self.config)


def serve(config: RunnerConfig, host: str = "127.0.0.1", port: int = 8081, http_threads: int | None = None) -> None:
    """Serve until interrupted."""
    # Enough HTTP threads that every slot plus the whole queue can hold a connection open.
    threads = http_threads or (config.model.n_seq_max + config.max_waiting + 4)
    RunnerServer(config, host, port, threads).run()
