"""`hearth runner`: one model served over loopback HTTP by gunicorn (one worker, threads)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

from gunicorn.app.base import BaseApplication
from gunicorn.errors import HaltServer
from gunicorn.workers.gthread import ThreadWorker

from app.runner.app import create_app
from app.runner.config import RunnerConfig
from app.sockets import no_delay

log = logging.getLogger(__name__)

# Exit status of a supervised runner whose worker died (EX_SOFTWARE): the supervisor reports a crash.
WORKER_DIED_EXIT = 70


def parent_alive(parent_pid: int, original_ppid: int) -> bool:
    """Whether `parent_pid` still exists and this process has not been re-parented since the start."""
    # A dead parent that nobody has reaped yet still answers kill(0); the re-parenting does not lie.
    if os.getppid() != original_ppid:
        return False
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> threading.Thread:
    """Start a daemon thread that sends SIGTERM to this process once `parent_pid` is gone."""
    original_ppid = os.getppid()

    def loop() -> None:
        while parent_alive(parent_pid, original_ppid):
            time.sleep(interval_s)
        log.warning("parent process %d is gone: shutting down", parent_pid)
        # In the arbiter SIGTERM is a graceful stop: the worker finishes and every byte is returned.
        os.kill(os.getpid(), signal.SIGTERM)

    t = threading.Thread(target=loop, name="hearth-parent-watch", daemon=True)
    t.start()
    return t


_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send `sig` to this process when its parent dies (False where it cannot)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _worker_forked(arbiter, worker) -> None:
    """In the new worker: die with the arbiter, even mid-stream."""
    # Gunicorn's own check of the parent only stops the worker gracefully, after its streams end; a
    # re-parented worker would keep the port and the model's memory meanwhile. SIGKILL frees both at once.
    if die_with_parent() and os.getppid() != arbiter.pid:
        os._exit(1)  # the arbiter died between the fork and the prctl


class RunnerWorker(ThreadWorker):
    """gunicorn's gthread worker that, told to stop, closes its idle kept-alive connections at once.

    gunicorn 27 keeps them open up to 2 s (gthread.STOP_KEEPALIVE_LINGER), so that a request racing the stop
    is answered with "Connection: close" instead of a dropped connection. Serve's relay and sampler keep one
    to every runner, so each eviction waited out those 2 s before the next model could load (a runner took
    2.4–3.1 s to exit under serve, 0.9 s without). Serve routes nothing more to a runner it stops; a request
    still in flight finishes as before (graceful_timeout)."""

    def _cap_keepalive(self, deadline):
        super()._cap_keepalive(time.monotonic())


class RunnerServer(BaseApplication):
    """Gunicorn with exactly one gthread worker: the engine and its KV cache live in that one process."""

    def __init__(self, config: RunnerConfig, host: str, port: int, http_threads: int, parent_pid: int | None = None):
        self.config = config
        # llama-server takes several comma-separated addresses; gunicorn listens on each.
        self.bind = [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in (x.strip() for x in host.split(",")) if h]
        self.http_threads = http_threads
        self.parent_pid = parent_pid
        super().__init__()

    def load_config(self):
        settings = {
            "bind": self.bind,
            "workers": 1,
            "worker_class": RunnerWorker,
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
        settings["when_ready"] = self._when_ready
        settings["post_fork"] = _worker_forked
        settings["worker_exit"] = _worker_exit
        if self.parent_pid is not None:
            settings["child_exit"] = _worker_exited
        for key, value in settings.items():
            self.cfg.set(key, value)

    def _when_ready(self, arbiter) -> None:
        no_delay(arbiter.LISTENERS)
        # Runs in the arbiter, before the worker is forked, so the watcher lives in the arbiter only.
        if self.parent_pid is not None:
            watch_parent(self.parent_pid)

    def load(self):
        # Runs in the worker after fork: the model and the engine thread belong to the worker.
        return create_app(self.config)



def _worker_exit(arbiter, worker) -> None:
    """In the worker, as it exits: stop the engine, so the KV disk tier writes the cached prefixes it lacks."""
    state = getattr(worker.wsgi, "state", None)
    if state is not None:
        try:
            state.shutdown()
        except Exception:
            log.exception("stopping the engine at exit failed")


def _worker_exited(arbiter, worker) -> None:
    """Supervised: a worker that dies while the arbiter still listens ends the runner as a crash."""
    # Gunicorn would fork a new worker and reload the model unseen; the supervisor must see the crash
    # instead, to record it, fail in-flight requests and restart under its memory budget. During a
    # stop the arbiter has already closed its listeners, so a normal shutdown never lands here.
    if arbiter.LISTENERS:
        raise HaltServer(f"worker (pid {worker.pid}) exited unexpectedly", WORKER_DIED_EXIT)


def serve(config: RunnerConfig, host: str = "127.0.0.1", port: int = 8081, http_threads: int | None = None,
          parent_pid: int | None = None) -> None:
    """Serve until interrupted, or until `parent_pid` (when given) is gone."""
    # Enough HTTP threads that every slot plus the whole queue can hold a connection open.
    threads = http_threads or (config.model.n_seq_max + config.max_waiting + 4)
    RunnerServer(config, host, port, threads, parent_pid=parent_pid).run()
