"""Runner processes on loopback (hearth runner or a stock llama-server): start, watch, stop, their keys and load split.

How a runner is started is app.residency.runner_spec; remote nodes are app.residency.remote."""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import psutil

from app.policy import RunnerKind
from app.residency.pagecache import PAGE_CACHE_SHARE, cached_fraction
from app.residency.runner_spec import RunnerSpec

log = logging.getLogger(__name__)

LOG_LINES = 500
# Where a runner started by serve finds its API key: the environment, which only its own user (and
# root) can read in /proc/<pid>/environ, never the command line, which `ps` shows everyone.
RUNNER_KEY_ENV = "HEARTH_RUNNER_API_KEY"
LLAMA_KEY_ENV = "LLAMA_API_KEY"  # llama.cpp's common/arg.cpp: --api-key reads it when the flag is absent
# A port picked free can be taken before the runner binds it; a new one is tried that many times.
MAX_PORT_TRIES = 3



@dataclass(frozen=True)
class LoadSplit:
    """A load's time taken apart, in ms; None where it was not measured.

    A hearth runner measures its own phases (its /health's load_timings): the weights read, the GPU upload
    (with GPU layers only), the context build, then its first request's KV restore and prefill. Of a stock
    llama-server only the whole (process start → /health ok, cold_start_ms) is known. The weights' source
    is judged by serve from the file's share in the page cache just before the runner started."""

    read_ms: float | None = None
    context_ms: float | None = None
    upload_ms: float | None = None
    restore_ms: float | None = None
    first_prefill_ms: float | None = None
    weights_cached: float | None = None  # the GGUF's share in the page cache before the load (0..1)
    kv_source: str | None = None
    measured_by_runner: bool = False

    @property
    def weights_source(self) -> str | None:
        """page_cache when nearly all of the file was in memory before the load, else disk; None: unknown."""
        if self.weights_cached is None:
            return None
        return "page_cache" if self.weights_cached >= PAGE_CACHE_SHARE else "disk"

    def event_fields(self) -> dict:
        """The residency event's columns."""
        return {"load_read_ms": self.read_ms, "load_context_ms": self.context_ms, "load_upload_ms": self.upload_ms,
                "load_restore_ms": self.restore_ms, "first_prefill_ms": self.first_prefill_ms,
                "weights_source": self.weights_source, "kv_source": self.kv_source}

    @classmethod
    def from_timings(cls, timings: dict | None, weights_cached: float | None) -> LoadSplit:
        """The split from a runner's load_timings (absent or not a dict: only the weights' source is known)."""
        if not isinstance(timings, dict):
            return cls(weights_cached=weights_cached)

        def ms(name: str) -> float | None:
            v = timings.get(name)
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else None

        kv = timings.get("kv_source")
        return cls(read_ms=ms("read_ms"), context_ms=ms("context_ms"), upload_ms=ms("upload_ms"),
                   restore_ms=ms("restore_ms"), first_prefill_ms=ms("first_prefill_ms"),
                   weights_cached=weights_cached, kv_source=kv if kv in ("ram", "disk", "none") else None,
                   measured_by_runner=True)


# Between a failed start's reason and the runner's log in its text: what comes after is the admin's to read.
RUNNER_LOG_MARK = "\n--- runner log ---\n"


class RunnerStartFailed(Exception):
    """The runner exited, reported a failed load, or was not ready in time."""

    def __init__(self, reason: str, log_tail: list[str]):
        self.reason = reason
        self.log_tail = log_tail
        tail = "\n".join(log_tail[-20:])
        super().__init__(f"{reason}{RUNNER_LOG_MARK}{tail}" if tail else reason)


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_runner_key() -> str:
    """A random API key for one runner: 256 bits, URL-safe."""
    return secrets.token_urlsafe(32)


# The keys of the runners this process started, by (host, port): the relay, the probes and the
# telemetry sampler find a runner's key from the URL they already have. An entry lives exactly as
# long as its runner, so a port reused by another process after a runner exits never gets the key.
_runner_keys: dict[tuple[str, int], str] = {}
_runner_keys_lock = threading.Lock()


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def runner_headers(url: str) -> dict[str, str]:
    """The Authorization header for a request to `url` when it is a runner this process started with a key."""
    with _runner_keys_lock:
        key = _runner_keys.get(_address(url))
    return {"Authorization": f"Bearer {key}"} if key else {}


def _remember_key(url: str, key: str) -> None:
    with _runner_keys_lock:
        _runner_keys[_address(url)] = key


def _forget_key(url: str, key: str) -> None:
    with _runner_keys_lock:
        if _runner_keys.get(_address(url)) == key:
            del _runner_keys[_address(url)]


def key_environment(kind: RunnerKind, key: str | None) -> dict[str, str]:
    """The variables that hand a runner of `kind` its key; {} without one."""
    if key is None:
        return {}
    return {LLAMA_KEY_ENV if kind == "llama-server" else RUNNER_KEY_ENV: key}


# --- parent-death signal ---------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _prctl = _libc.prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _prctl = None


def _die_with_parent(parent_pid: int, sig: int) -> Callable[[], None] | None:
    """A preexec_fn that asks the kernel to send `sig` to the child when its parent thread exits."""
    if _prctl is None:
        return None

    def preexec() -> None:
        # Runs between fork and exec, so it does as little as it can: prctl was looked up beforehand.
        _prctl(_PR_SET_PDEATHSIG, sig)
        # The parent may have died between fork and prctl, in which case no signal will ever come.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), sig)

    return preexec


def death_signal(kind: RunnerKind) -> int:
    """The signal a runner gets when the process that started it dies."""
    # llama-server's SIGTERM handler takes mutexes (the task queue's): landing while its main thread
    # holds one, it deadlocks with SIGTERM masked, for good (seen in this project's tests). With the
    # supervisor gone there is nobody left to serve, so the kernel's SIGKILL is the safe choice.
    # Gunicorn's handler only queues the signal: the hearth runner stops gracefully.
    return int(signal.SIGKILL if kind == "llama-server" else signal.SIGTERM)


# PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process: spawning
# from short-lived request threads would kill runners when those threads end. This thread lives as
# long as the process, so the signal means exactly "the supervisor process is gone".
class _Spawner:
    """One long-lived daemon thread that forks every runner."""

    def __init__(self):
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def popen(self, args: list[str], **kwargs) -> subprocess.Popen:
        """subprocess.Popen(args, **kwargs), run on the spawner thread."""
        with self._lock:
            # After a fork (gunicorn preloading, say) the thread exists only in the parent.
            if self._thread is None or not self._thread.is_alive() or self._pid != os.getpid():
                self._pid = os.getpid()
                self._queue = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._run, args=(self._queue,), name="hearth-spawner",
                                                daemon=True)
                self._thread.start()
            q = self._queue
        fut: Future = Future()
        q.put((args, kwargs, fut))
        return fut.result()

    @staticmethod
    def _run(q: queue.SimpleQueue) -> None:
        while True:
            args, kwargs, fut = q.get()
            try:
                fut.set_result(subprocess.Popen(args, **kwargs))
            except BaseException as exc:
                fut.set_exception(exc)


_spawner = _Spawner()


# --- local runner ----------------------------------------------------------------------------

# A runner's life: pick a free port → spawn it in its own session (process group) → keep its log
# lines in a ring buffer → poll /health until 200 (fail fast on exit or 500) → serve → stop with
# SIGTERM to the whole group, then SIGKILL. A watcher thread waits for the group leader, kills what
# is left of the group and reports every exit after a successful start, expected or not.
class RunnerProcess:
    """One runner process (and its children) serving one model on a loopback port."""

    def __init__(self, spec: RunnerSpec,
                 on_exit: Callable[[RunnerProcess, int, bool], None] | None = None,
                 parent_pid: int | None = None, api_key: str | None = None):
        self.spec = spec
        self.on_exit = on_exit
        self.parent_pid = parent_pid if parent_pid is not None else os.getpid()
        # Required by the runner on every route but /health (None: a runner anyone on the host may call).
        self.api_key = api_key
        self.port: int | None = None
        self.cold_start_ms: float | None = None
        # The load taken apart (known once start() returned): its phases as far as the runner reports them.
        self.load_split = LoadSplit()
        self._weights_cached: float | None = None
        self.returncode: int | None = None
        self._proc: subprocess.Popen | None = None
        self._log: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        self._lock = threading.Lock()
        # Guards the hand-over between start() and the watcher: exactly one of them reports an exit.
        self._ready = False
        self._stopping = False
        self._exited = threading.Event()
        self._reader: threading.Thread | None = None
        self._watcher: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"<RunnerProcess {self.spec.model_name} pid={self.pid} url={self.url}>"

    @property
    def url(self) -> str | None:
        """Base URL, once a port is chosen."""
        return f"http://127.0.0.1:{self.port}" if self.port else None

    @property
    def headers(self) -> dict[str, str]:
        """What a request to this runner must carry: its key as a bearer token, when it has one."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def pid(self) -> int | None:
        """PID of the process we started (gunicorn's arbiter, or llama-server)."""
        return self._proc.pid if self._proc else None

    @property
    def alive(self) -> bool:
        """Whether the process we started is still running."""
        return self._proc is not None and self.poll() is None

    def poll(self) -> int | None:
        """The exit code once the process has exited, asking the kernel if the watcher has not yet."""
        if self._proc is None or self._exited.is_set():
            return self.returncode
        try:
            # WNOWAIT: look without reaping; the watcher stays the only one that reaps.
            info = os.waitid(os.P_PID, self._proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            # Already reaped, so dead: the watcher is between reaping and recording the code.
            self._exited.wait(1)
            return self.returncode if self.returncode is not None else self._proc.returncode
        if info is not None:
            return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        # A killed multithreaded process is waitable only once all its threads are gone; meanwhile
        # its leader already shows as a zombie. A client refused by it must not be told it lives.
        if self._leader_exiting():
            self._exited.wait(1)
            return self.returncode
        return None

    def _leader_exiting(self) -> bool:
        try:
            return psutil.Process(self._proc.pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def log_tail(self, n: int = 50) -> list[str]:
        """The last `n` lines the runner wrote to stdout or stderr."""
        with self._lock:
            lines = list(self._log)
        return lines[-n:] if n > 0 else []

    def rss_bytes(self) -> int:
        """Resident memory of the whole process tree (arbiter + worker); 0 when not running."""
        if not self.alive:
            return 0
        total = 0
        for p in self._tree():
            try:
                total += p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return total

    def pids(self) -> list[int]:
        """PIDs of the process tree right now."""
        return [p.pid for p in self._tree()]

    def _tree(self) -> list[psutil.Process]:
        if not self.alive:
            return []
        try:
            root = psutil.Process(self._proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def start(self, timeout_s: float = 120) -> RunnerProcess:
        """Spawn the runner and wait for /health 200; raises RunnerStartFailed with the log tail."""
        for attempt in range(MAX_PORT_TRIES):
            try:
                return self._start_once(timeout_s)
            except RunnerStartFailed as exc:
                in_use = any("address already in use" in line.lower() for line in exc.log_tail)
                if not in_use or attempt == MAX_PORT_TRIES - 1 or self._stopping:
                    raise
                log.info("port %s was taken before %s could bind it; trying another", self.port, self.spec.model_name)
                self._reset()
        raise AssertionError("unreachable")

    def _reset(self) -> None:
        if self.url and self.api_key:
            _forget_key(self.url, self.api_key)
        self._proc = None
        self.port = None
        self.returncode = None
        self._exited = threading.Event()
        with self._lock:
            self._log.clear()

    def _start_once(self, timeout_s: float) -> RunnerProcess:
        if self._stopping:
            raise RunnerStartFailed("stopped before it started", [])
        self.port = free_port()
        args = self.spec.command(self.port, parent_pid=self.parent_pid if self.spec.kind == "hearth" else None)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # A key serve's own environment happens to hold is not this runner's: only ours is passed.
        for name in (RUNNER_KEY_ENV, LLAMA_KEY_ENV):
            env.pop(name, None)
        env.update(key_environment(self.spec.kind, self.api_key))
        if self.api_key:
            _remember_key(self.url, self.api_key)
        # Just before the start: did the weights come from memory or the disk (mincore, a few ms for a big file)?
        self._weights_cached = cached_fraction(self.spec.model_path)
        t0 = time.monotonic()
        try:
            self._proc = _spawner.popen(
                args,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                # Its own process group: stop() and crash clean-up reach the worker even once the
                # arbiter is gone, and a Ctrl-C meant for `hearth serve` is not delivered twice.
                start_new_session=True,
                preexec_fn=_die_with_parent(os.getpid(), death_signal(self.spec.kind)),
                env=env,
                close_fds=True,
            )
        except OSError as exc:
            if self.api_key:
                _forget_key(self.url, self.api_key)
            raise RunnerStartFailed(f"could not start {args[0]}: {exc}", [])
        self._reader = threading.Thread(target=self._read_log, args=(self._proc,), daemon=True,
                                        name=f"runner-log-{self._proc.pid}")
        self._reader.start()
        self._watcher = threading.Thread(target=self._watch, args=(self._proc, self._exited, self._reader, self.url),
                                         daemon=True,
                                         name=f"runner-watch-{self._proc.pid}")
        self._watcher.start()
        try:
            self._wait_healthy(t0 + timeout_s, timeout_s)
        except RunnerStartFailed:
            self._terminate(10)
            raise
        self.cold_start_ms = (time.monotonic() - t0) * 1000
        log.info("runner %s ready on %s (pid %d) in %.0f ms", self.spec.model_name, self.url, self.pid,
                 self.cold_start_ms)
        return self

    def _wait_healthy(self, deadline: float, timeout_s: float) -> None:
        with httpx.Client(base_url=self.url, timeout=2.0, headers=self.headers) as client:
            while True:
                if self._exited.wait(0.1):
                    # Let the reader drain the last lines: they hold the reason.
                    self._reader.join(2)
                    raise RunnerStartFailed(f"runner exited with code {self._proc.returncode} while loading",
                                            self.log_tail(LOG_LINES))
                if self._stopping:
                    raise RunnerStartFailed("stopped while loading", self.log_tail(LOG_LINES))
                try:
                    r = client.get("/health")
                except httpx.TransportError:
                    r = None
                if r is not None and r.status_code == 200:
                    self.load_split = LoadSplit.from_timings(_json_field(r, "load_timings"), self._weights_cached)
                    with self._lock:
                        # The watcher checks the flag under the same lock: one of us reports an exit.
                        if not self._exited.is_set() and not self._stopping:
                            self._ready = True
                            return
                    continue
                if r is not None and r.status_code == 500:
                    raise RunnerStartFailed(f"model failed to load: {_error_message(r)}", self.log_tail(LOG_LINES))
                if time.monotonic() >= deadline:
                    raise RunnerStartFailed(f"not ready within {timeout_s:g} s", self.log_tail(LOG_LINES))

    def _read_log(self, proc: subprocess.Popen) -> None:
        for raw in proc.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            with self._lock:
                self._log.append(line)
        proc.stdout.close()

    def _watch(self, proc: subprocess.Popen, exited: threading.Event, reader: threading.Thread, url: str) -> None:
        try:
            # Wait without reaping: while the leader is a zombie its PID, our group id, cannot be reused.
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
            self._signal_group(proc.pid, signal.SIGKILL)
        except ChildProcessError:
            pass
        rc = proc.wait()
        self.returncode = rc
        if self.api_key:
            _forget_key(url, self.api_key)
        exited.set()
        reader.join(2)
        with self._lock:
            report = self._ready
            expected = self._stopping
        if not expected:
            log.warning("runner %s (pid %d) exited with code %s", self.spec.model_name, proc.pid, rc)
        if report and self.on_exit is not None:
            try:
                self.on_exit(self, rc, expected)
            except Exception:
                log.exception("on_exit callback of %s failed", self.spec.model_name)

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout_s: float = 10) -> int | None:
        """SIGTERM the process group, SIGKILL what is left after `timeout_s`; returns the exit code."""
        with self._lock:
            self._stopping = True
        if self._proc is None:
            return None
        self._terminate(timeout_s)
        return self.returncode

    def _terminate(self, timeout_s: float) -> None:
        tree = self._tree()
        if self.alive:
            self._signal_group(self._proc.pid, signal.SIGTERM)
        if not self._exited.wait(timeout_s):
            log.warning("runner %s (pid %d) ignored SIGTERM for %g s: killing it", self.spec.model_name,
                        self._proc.pid, timeout_s)
            self._signal_group(self._proc.pid, signal.SIGKILL)
            self._exited.wait()
        # Anything of the tree that left the group still goes: no runner outlives its stop().
        for p in tree[1:]:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
            except psutil.NoSuchProcess:
                pass
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(5)


    def read_load_split(self) -> LoadSplit | None:
        """The load's split as the runner reports it now (its first request's parts once that one is done);
        None when it cannot be asked or tells none (a stock llama-server)."""
        if not self.alive or self.url is None:
            return None
        try:
            # verify=False: a local runner is plain http, and it spares a fresh SSL context per call.
            r = httpx.get(f"{self.url}/health", timeout=2.0, headers=self.headers, verify=False)
        except httpx.HTTPError:
            return None
        timings = _json_field(r, "load_timings") if r.status_code == 200 else None
        return LoadSplit.from_timings(timings, self._weights_cached) if timings is not None else None


def _json_field(r: httpx.Response, name: str):
    """A field of a JSON object answer, or None (no JSON, not an object, no such field)."""
    try:
        body = r.json()
    except ValueError:
        return None
    return body.get(name) if isinstance(body, dict) else None


def _error_message(r: httpx.Response) -> str:
    try:
        err = r.json().get("error")
        return err.get("message") if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return r.text[:500]
