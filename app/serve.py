"""`hearth serve`: the Flask app under gunicorn with exactly ONE gevent worker.

APScheduler jobs and the runner supervisor live inside the app, so a second worker would
run every job twice and start a second copy of every model: the config refuses it.

Concurrency is gevent's (greenlets on one OS thread, sockets made cooperative): a request waiting
in admission or streaming its answer costs a greenlet and a descriptor, not an OS thread, so the
class policy, not a thread pool, decides who reaches a runner (docs/architecture.md, "Concurrency").
The runners are separate processes, so nothing CPU-heavy runs on this loop.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import socket
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from gunicorn.app.base import BaseApplication
from gunicorn.workers.base_async import AsyncWorker
from gunicorn.workers.ggevent import GeventWorker

from app.paths import data_dir, mend_private, private_mode
from app.sockets import no_delay

DEFAULT_BIND = "127.0.0.1:8080"
# On SIGTERM the arbiter SIGKILLs the worker GRACEFUL_TIMEOUT_S later, and a killed worker stops no
# runner. So answers in flight get DRAIN_S to finish, then the runners are stopped (in parallel,
# each SIGKILLed by the supervisor if not gone in 10 s) while the worker still lives: 8 + 10 < 25.
# Docker's stop_grace_period (30 s in docker-compose.yml) covers the whole sequence.
GRACEFUL_TIMEOUT_S = 25
DRAIN_S = 8.0
# How often the stopping worker looks whether its last connection has ended (gunicorn's gevent worker: 1 s).
DRAIN_POLL_S = 0.05
SEND_BUFFER_BYTES = 64 * 1024

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A gunicorn setting Hearth cannot run with."""


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client connection may cost serve: the timeouts and connection cap of the Gateway settings."""

    header_timeout_s: float = 5.0
    keepalive_s: float = 10.0
    client_stall_s: float = 30.0
    max_connections: int = 4096

    @classmethod
    def from_store(cls, values: dict) -> ConnectionLimits:
        """The limits from stored settings (name → value, None or absent for the default)."""
        names = ("header_timeout_s", "keepalive_s", "client_stall_s", "max_connections")
        return cls(**{k: values[k] for k in names if values.get(k) is not None})


class HearthWorker(GeventWorker):
    """gunicorn's gevent worker with a deadline on every wait a client can impose.

    - the first request's headers must arrive within header_timeout_s (half-open connections
      are closed instead of piling up);
    - an idle keep-alive connection waits keepalive_s for its next request, then is closed;
    - every read or write on the client socket gives up after client_stall_s without progress
      (a stream reader that stopped reading: the write fails, the answer's generator is
      closed, its slot, lease and runner sequence are freed).
    """

    limits = ConnectionLimits()

    def patch(self):
        """gevent's monkey patching, plus os.waitid, which it leaves blocking.

        The runner supervisor's watcher waits for its runner's exit with os.waitid (without
        reaping, so the group id stays reserved); unpatched, that one call would stop the
        whole loop until the runner exits. It is sent to gevent's pool of real threads instead.
        """
        super().patch()
        import gevent

        blocking_waitid = os.waitid

        def in_thread(idtype, ident, options):
            # Returned, not raised: the pool would print the traceback of an error the caller handles
            # (ChildProcessError once gevent's SIGCHLD watcher has reaped the runner first).
            try:
                return blocking_waitid(idtype, ident, options), None
            except OSError as exc:
                return None, exc

        def waitid(idtype, ident, options):
            if options & os.WNOHANG:
                return blocking_waitid(idtype, ident, options)
            result, error = gevent.get_hub().threadpool.apply(in_thread, (idtype, ident, options))
            if error is not None:
                raise error
            return result

        os.waitid = waitid

    def run(self):
        """gunicorn's GeventWorker.run (a StreamServer per socket, the heartbeat each second, then the drain), woken
        by SIGTERM at once rather than at its next one-second tick, and ending the drain within DRAIN_POLL_S of the
        last connection: an idle serve stops in ~0.55 s instead of ~1.5 s (SIGTERM to exit, measured), and `docker
        stop` returns as soon."""
        import gevent
        from gevent.event import Event
        from gevent.pool import Pool
        from gevent.server import StreamServer
        from gunicorn.sock import ssl_context

        self._stopping = Event()
        ssl_args = {"ssl_context": ssl_context(self.cfg)} if self.cfg.is_ssl else {}
        servers = []
        for sock in self.sockets:
            sock.setblocking(1)
            server = StreamServer(sock, handle=partial(self.handle, sock), spawn=Pool(self.worker_connections),
                                  **ssl_args)
            server.start()
            servers.append(server)
        while self.alive:
            self.notify()
            self._stopping.wait(1.0)
        for server in servers:
            server.close()  # stop accepting; connections in flight go on
        deadline = time.monotonic() + self.cfg.graceful_timeout
        while any(server.pool.free_count() != server.pool.size for server in servers):
            if time.monotonic() >= deadline:
                log.warning("worker graceful timeout: closing %d connections",
                            sum(server.pool.size - server.pool.free_count() for server in servers))
                for server in servers:
                    server.stop(timeout=1)
                return
            self.notify()
            gevent.sleep(DRAIN_POLL_S)

    def handle_exit(self, sig, frame):
        """SIGTERM: stop, and wake run() from its heartbeat wait (from a greenlet: this is a signal handler)."""
        super().handle_exit(sig, frame)
        stopping = getattr(self, "_stopping", None)
        if stopping is not None:
            import gevent

            gevent.spawn(stopping.set)

    def handle(self, listener, client, addr):
        """Serve one connection with the socket timeout set (gunicorn's own handle sets blocking, no timeout)."""
        client.setblocking(1)
        client.settimeout(self.limits.client_stall_s)
        # Linux grows a loopback socket's send buffer to megabytes: a client that stops reading could
        # park a whole long answer there (the stall timeout would never fire) and 500 of them
        # gigabytes of kernel memory. 64 KiB (the kernel doubles it) still fills a LAN link.
        client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._conn_state().first = True
        try:
            AsyncWorker.handle(self, listener, client, addr)
        except TimeoutError:
            log.debug("closed a connection that made no progress for %s s", self.limits.client_stall_s)

    def _conn_state(self) -> threading.local:
        # Under gevent's patching threading.local is greenlet-local: one per connection.
        state = getattr(self, "_local", None)
        if state is None:
            state = self._local = threading.local()
        return state

    def timeout_ctx(self):
        """The deadline for the next request's headers: short for a new connection, keepalive_s between requests."""
        import gevent

        state = self._conn_state()
        first = getattr(state, "first", True)
        state.first = False
        return gevent.Timeout(self.limits.header_timeout_s if first else self.limits.keepalive_s, False)


def worker_class(limits: ConnectionLimits) -> type[HearthWorker]:
    """HearthWorker bound to `limits` (the worker is forked, so a class attribute is how it gets them)."""
    return type("HearthWorker", (HearthWorker,), {"limits": limits})


def gunicorn_settings(bind: str, limits: ConnectionLimits | None = None, workers: int = 1) -> dict:
    """The gunicorn settings for `hearth serve`; refuses more than one worker."""
    if workers != 1:
        raise ConfigError(
            f"hearth serve must run exactly one gunicorn worker (got {workers}): the scheduler and the "
            "model runners live in the worker; one gevent worker holds thousands of connections"
        )
    limits = limits or ConnectionLimits()
    return {
        "bind": bind,
        "workers": 1,
        "worker_class": worker_class(limits),
        "worker_connections": limits.max_connections,
        # The worker's heartbeat runs on the same loop as the requests: a loop stalled this long is a bug.
        "timeout": 120,
        "graceful_timeout": GRACEFUL_TIMEOUT_S,
        # gunicorn 27's control socket: nothing of Hearth uses it, and in the container its default folder
        # ($HOME/.gunicorn, the image user's home) is not writable by PUID, which logged an error at every start.
        "control_socket_disable": True,
        # gunicorn only checks it is non-zero (our timeout_ctx applies the exact value); it takes whole seconds.
        "keepalive": max(1, round(limits.keepalive_s)),
        "accesslog": None,
        "errorlog": "-",
        "loglevel": "warning",
        "preload_app": False,
        "proc_name": "hearth-serve",
        "when_ready": lambda arbiter: no_delay(arbiter.LISTENERS),
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
        # Signal handlers run on gevent's loop, which must not block: a greenlet waits instead of a thread.
        import gevent

        gevent.spawn_later(DRAIN_S, shutdown_app, worker.wsgi)

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


STORED = ("bind", "header_timeout_s", "keepalive_s", "client_stall_s", "max_connections")


def stored_settings() -> dict:
    """The bind address and connection limits saved on the Settings page (None where unset)."""
    from app.store.db import open_store
    from app.store.settings import get_setting

    engine, sessions = open_store(data_dir())
    try:
        with sessions() as s:
            return {name: get_setting(s, name) for name in STORED}
    finally:
        engine.dispose()


def raise_descriptor_limit(wanted: int) -> None:
    """Lift the soft open-files limit toward `wanted` (each streamed request holds two sockets)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def check_private_files(data: Path) -> list[str]:
    """Make the data folder's private files owner-only, warning about each one found open; returns the warnings."""
    lines = [f"{path} was readable by other users of this machine (mode {old:04o}); it holds the household's "
             f"words or secrets, so it is now owner-only ({'0700' if path.is_dir() else '0600'})"
             if private_mode(path) else
             f"{path} is readable by other users of this machine (mode {old:04o}) and this user (uid {os.getuid()}) "
             f"may not change it: it holds the household's words or secrets; make it owner-only "
             f"(chmod {'700' if path.is_dir() else '600'}) as its owner"
             for path, old in mend_private(data)]
    for line in lines:
        log.warning(line)
    return lines


def serve(bind: str | None = None) -> None:
    """Run Hearth until interrupted."""
    from app.factory import create_app

    check_private_files(data_dir())
    stored = stored_settings()
    # The default model is not assembled here: on a first run the worker assembles it in the
    # background, so the dashboard is reachable at once and shows the progress (the log too).
    bind = bind or os.environ.get("HEARTH_BIND") or stored["bind"] or DEFAULT_BIND
    limits = ConnectionLimits.from_store(stored)
    raise_descriptor_limit(2 * limits.max_connections + 256)
    HearthServer(gunicorn_settings(bind, limits), create_app).run()
