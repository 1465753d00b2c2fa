"""Runner processes on loopback (hearth runner or a stock llama-server) and remote nodes over HTTP."""

from __future__ import annotations

import collections
import ctypes
import json
import logging
import os
import queue
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import lru_cache
from urllib.parse import urlsplit

import httpx
import psutil

from app.engine.kv_tiers import DEFAULT_CACHE_DISK_MAX_AGE_H, DEFAULT_CACHE_DISK_MIB, DEFAULT_CACHE_RAM_MIB
from app.engine.kv_types import DEFAULT_KV_TYPE, KV_TYPE_BYTES
from app.engine.speculation import NGRAM_TYPES, SpecConfig
from app.exposition import parse_exposition
from app.hardware import cpu_has_amx, usable_cores
from app.paths import KV_CACHE_DIR  # noqa: F401  (re-exported: the services name it from here)
from app.policy import RUNNER_KINDS, RunnerKind
from app.residency.pagecache import PAGE_CACHE_SHARE, cached_fraction

log = logging.getLogger(__name__)

LOG_LINES = 500
# Where a runner started by serve finds its API key: the environment, which only its own user (and
# root) can read in /proc/<pid>/environ, never the command line, which `ps` shows everyone.
RUNNER_KEY_ENV = "HEARTH_RUNNER_API_KEY"
LLAMA_KEY_ENV = "LLAMA_API_KEY"  # llama.cpp's common/arg.cpp: --api-key reads it when the flag is absent
# A port picked free can be taken before the runner binds it; a new one is tried that many times.
MAX_PORT_TRIES = 3


# A model's "Speculative decoding" setting (runner_settings.speculation, migration 0013): auto (None stored
# means the same) lets serve choose, off never drafts, an n-gram type drafts with that type. Drafting is
# switched by load inside a hearth runner either way (it stands aside as the batch fills).
SPEC_AUTO = "auto"
SPEC_OFF = "off"
SPECULATION_SETTINGS = (SPEC_AUTO, SPEC_OFF, *NGRAM_TYPES)
# What auto means for a hearth runner: Hearth's own n-gram lookup, drafting from the sequence's context.
SPEC_AUTO_HEARTH = "ngram-lookup"
# What auto means for either kind when the model has a draft model (runner_settings.draft_model): -md drafts.
SPEC_DRAFT_MODEL = "draft-simple"
# Hearth's own type, which a stock llama-server does not know (it refuses an unknown --spec-type).
HEARTH_ONLY_SPEC_TYPES = frozenset({"ngram-lookup"})


def spec_type_for(kind: RunnerKind, setting: str | None, draft_model: bool = False) -> str | None:
    """The --spec-type a runner of `kind` is started with for a model's speculation setting; None: no flag.

    hearth: auto (or unset) is ngram-lookup, off is none, a type is that type. llama-server: auto leaves its
    own default (no flag), off is none, a type is that type, except Hearth's ngram-lookup (no flag: the
    Models page refuses the pair, this keeps a stored one from stopping the runner's start). With a draft model
    chosen, auto is draft-simple for either kind (a hearth runner's drafts then stand aside while they do not pay);
    an n-gram type chosen by hand stays that type."""
    value = setting or SPEC_AUTO
    if value not in SPECULATION_SETTINGS:
        raise ValueError(f"unknown speculation setting {value!r}; one of: {', '.join(SPECULATION_SETTINGS)}")
    if value == SPEC_OFF:
        return "none"
    if value == SPEC_AUTO and draft_model:
        return SPEC_DRAFT_MODEL
    if kind == "llama-server":
        return None if value == SPEC_AUTO or value in HEARTH_ONLY_SPEC_TYPES else value
    return SPEC_AUTO_HEARTH if value == SPEC_AUTO else value


def speculation_problem(kind: RunnerKind, setting: str | None) -> str | None:
    """Why a speculation setting cannot go with a runner kind, or None (the Models page's check)."""
    if setting is not None and setting not in SPECULATION_SETTINGS:
        return f"choose one of: {', '.join(SPECULATION_SETTINGS)}"
    if kind == "llama-server" and setting in HEARTH_ONLY_SPEC_TYPES:
        return (f"{setting} is Hearth's own; a stock llama-server drafts with ngram-simple, ngram-map-k, "
                "ngram-map-k4v or ngram-mod (or choose auto: its own default)")
    return None


# llama-server's own --cache-ram default (llama-server --help of the pinned build): it keeps evicted prompt KV
# in host RAM too, and serve passes it no --cache-ram.
LLAMA_SERVER_CACHE_RAM_MIB = 8192


@dataclass(frozen=True)
class RunnerSpec:
    """How to run one model locally."""

    model_name: str
    model_path: str
    kind: RunnerKind = "hearth"
    binary_path: str | None = None
    n_ctx: int = 4096
    parallel: int = 4
    n_batch: int = 512
    threads: int = field(default_factory=usable_cores)
    gpu_layers: int = 0
    mode: str = "continuous"
    extra_args: tuple[str, ...] = ()
    prefix_cache: bool = True  # hearth runners only; llama-server keeps its own default (prompt caching on)
    # --spec-type (llama-server's name, see spec_type_for); None passes no flag: the runner's own default.
    spec_type: str | None = None
    # hearth runners' KV tiers: --cache-ram MiB (-1 no limit, 0 off), --cache-disk folder (None: off) and its MiB.
    cache_ram_mib: int = DEFAULT_CACHE_RAM_MIB
    cache_disk_dir: str | None = None
    cache_disk_mib: int = DEFAULT_CACHE_DISK_MIB
    cache_disk_max_age_h: float = DEFAULT_CACHE_DISK_MAX_AGE_H  # 0: never expire
    # The model's vision projector (the catalog's pairing): --mmproj for either kind, unless runner_args
    # name --mmproj or --no-mmproj themselves (theirs win).
    mmproj: str | None = None
    # The draft model's file (runner_settings.draft_model, resolved by the catalog): -md while --spec-type is
    # draft-simple, unless runner_args name a draft model themselves.
    draft_model_path: str | None = None
    # hearth runners with a projector: fetch http(s) image URLs (public hosts, plus these LAN ones).
    image_url_fetch: bool = False
    image_url_hosts: str | None = None
    # KV cache types (runner_settings.cache_type_k/_v; -ctk/-ctv for either kind, unless runner_args name them).
    # f16 passes no flag: both runners' own default.
    cache_type_k: str = DEFAULT_KV_TYPE
    cache_type_v: str = DEFAULT_KV_TYPE
    # Experts kept in RAM (runner_settings.n_cpu_moe: N the first N layers' with --n-cpu-moe, -1 all with --cpu-moe)
    # and the GPUs (--device names, --tensor-split shares, --split-mode, --main-gpu); the defaults pass no flag.
    n_cpu_moe: int = 0
    devices: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] = ()
    split_mode: str = "layer"
    main_gpu: int = 0

    def __post_init__(self):
        if self.kind not in RUNNER_KINDS:
            raise ValueError(f"unknown runner kind {self.kind!r}")
        if self.kind == "llama-server" and not self.binary_path:
            raise ValueError("a llama-server runner needs binary_path")
        object.__setattr__(self, "extra_args", tuple(self.extra_args))

    def _arg(self, *names: str) -> str | None:
        """The value the model's runner_args give the last of these flags (`--flag V` or `--flag=V`), or None."""
        value = None
        args = self.extra_args
        for i, a in enumerate(args):
            flag, eq, inline = a.partition("=")
            if flag in names:
                value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
        return value

    @property
    def mmproj_flag(self) -> list[str]:
        """The --mmproj arguments of the paired projector, unless the model's runner_args choose themselves."""
        if self.mmproj is None or self._arg("--mmproj", "-mm") is not None or "--no-mmproj" in self.extra_args:
            return []
        return ["--mmproj", self.mmproj]

    @property
    def spec_flag(self) -> list[str]:
        """The --spec-type arguments, unless the model's runner_args name the type themselves (theirs win)."""
        if self.spec_type is None or self._arg("--spec-type") is not None:
            return []
        return ["--spec-type", self.spec_type]

    @property
    def draft_flag(self) -> list[str]:
        """-md with the draft model's file while the runner drafts with a model, unless runner_args give one."""
        if (self.draft_model_path is None or self.effective_spec_type != SPEC_DRAFT_MODEL
                or self._arg("--spec-draft-model", "-md", "--model-draft") is not None):
            return []
        return ["-md", self.draft_model_path]

    @property
    def kv_type_flag(self) -> list[str]:
        """-ctk/-ctv of the model's KV cache types where not f16, unless runner_args name the flag themselves."""
        flags = []
        for flag, long, value in (("-ctk", "--cache-type-k", self.cache_type_k), ("-ctv", "--cache-type-v", self.cache_type_v)):
            if value != DEFAULT_KV_TYPE and self._arg(flag, long) is None:
                flags += [flag, value]
        return flags

    @property
    def placement_flag(self) -> list[str]:
        """--cpu-moe / --n-cpu-moe and the GPU flags of the model's settings, each unless runner_args name it."""
        flags: list[str] = []
        if self.n_cpu_moe and self._arg("--cpu-moe", "-cmoe", "--n-cpu-moe", "-ncmoe") is None \
                and not {"--cpu-moe", "-cmoe"} & set(self.extra_args):
            flags += ["--cpu-moe"] if self.n_cpu_moe < 0 else ["--n-cpu-moe", str(self.n_cpu_moe)]
        for names, value, default in (
            (("--device", "-dev"), ",".join(self.devices), ""),
            (("--tensor-split", "-ts"), ",".join(f"{x:g}" for x in self.tensor_split), ""),
            (("--split-mode", "-sm"), self.split_mode, "layer"),
            (("--main-gpu", "-mg"), str(self.main_gpu), "0"),
        ):
            if value != default and self._arg(*names) is None:
                flags += [names[0], value]
        return flags

    @property
    def kv_types(self) -> tuple[str, str]:
        """The KV cache types (K, V) the runner gets: runner_args' own, else the setting's (what the estimate counts)."""
        k = self._arg("-ctk", "--cache-type-k") or self.cache_type_k
        v = self._arg("-ctv", "--cache-type-v") or self.cache_type_v
        # A name the runner refuses stops it from starting; the estimate counts the setting's instead.
        return (k if k in KV_TYPE_BYTES else self.cache_type_k, v if v in KV_TYPE_BYTES else self.cache_type_v)

    @property
    def effective_spec_type(self) -> str | None:
        """The --spec-type the runner gets: runner_args' own, else the setting's; None: the runner's default."""
        return self._arg("--spec-type") or self.spec_type

    @property
    def ram_tier_mib(self) -> int:
        """The host RAM, in MiB, the runner's RAM tier may fill with evicted prompt KV (-1: no limit, 0: none):
        its --cache-ram (runner_args' own wins), a stock llama-server's default when none is passed."""
        if self.kind == "hearth" and not self.prefix_cache:
            return 0  # the tiers hold prefix-cache entries: none without the cache
        own = self._arg("--cache-ram", "-cram")
        if own is not None:
            try:
                return int(own)
            except ValueError:
                pass  # a value the runner refuses: it will not start, and the setting's figure stands
        return LLAMA_SERVER_CACHE_RAM_MIB if self.kind == "llama-server" else self.cache_ram_mib

    @property
    def n_outputs_extra(self) -> int:
        """Logit rows a hearth runner reserves beyond one per slot for verifying drafts (its draft_max)."""
        kind = self.effective_spec_type
        if self.kind != "hearth" or kind in (None, "none"):
            return 0
        n_max = self._arg("--spec-draft-n-max", "--draft", "--draft-n", "--draft-max")
        try:
            config = SpecConfig(type=kind, n_max=int(n_max) if n_max is not None else None)
        except ValueError:
            return 0  # a type or length the runner refuses: it will not start, so it reserves nothing
        return config.draft_max if config.enabled else 0

    def command(self, port: int, parent_pid: int | None = None) -> list[str]:
        """The command line that serves this model on 127.0.0.1:`port`."""
        if self.kind == "llama-server":
            cmd = [
                self.binary_path, "--model", self.model_path, "--host", "127.0.0.1", "--port", str(port),
                "--ctx-size", str(self.n_ctx), "--parallel", str(self.parallel),
                "--batch-size", str(self.n_batch), "--threads", str(self.threads),
                "--n-gpu-layers", str(self.gpu_layers), "--alias", self.model_name,
                # One KV pool shared by every slot, as the hearth runner has; /metrics is off by default.
                "--kv-unified", "--metrics", "--no-webui",
            ]
            # The same choice the hearth runner makes: the pinned build's AMX repack path crashes.
            if cpu_has_amx():
                cmd.append("--no-repack")
            # `mode` is the hearth engine's scheduler; llama-server always batches continuously.
            return cmd + self.mmproj_flag + self.spec_flag + self.draft_flag + self.kv_type_flag + self.placement_flag + list(self.extra_args)
        cmd = [
            sys.executable, "-m", "app.cli", "runner", "--model", self.model_path,
            "--host", "127.0.0.1", "--port", str(port), "--ctx", str(self.n_ctx),
            "--parallel", str(self.parallel), "--batch", str(self.n_batch), "--threads", str(self.threads),
            "--gpu-layers", str(self.gpu_layers), "--mode", self.mode, "--alias", self.model_name,
            # The gateway's load probe and the telemetry sampler read /metrics (off by default, as llama-server).
            "--metrics",
            # Nothing started by Hearth is meant for a browser: no web page may read a runner's answers.
            "--cors-origins", "none",
        ]
        if parent_pid is not None:
            cmd += ["--parent-pid", str(parent_pid)]
        if not self.prefix_cache:
            cmd.append("--no-prefix-cache")
        cmd += ["--cache-ram", str(self.cache_ram_mib)]
        if self.cache_disk_dir:
            cmd += ["--cache-disk", self.cache_disk_dir, "--cache-disk-mib", str(self.cache_disk_mib),
                    "--cache-disk-max-age-h", f"{self.cache_disk_max_age_h:g}"]
        if self.image_url_fetch and self.mmproj_flag:
            cmd += ["--image-url-fetch"] + (["--image-url-hosts", self.image_url_hosts] if self.image_url_hosts else [])
        return cmd + self.mmproj_flag + self.spec_flag + self.draft_flag + self.kv_type_flag + self.placement_flag + list(self.extra_args)


# The flags serve sets on every runner itself (address, key, identity) or from settings of their own (slots,
# cells, batch, threads, GPU layers, mode): the per-model runner_args setting may not name them.
SERVE_RUNNER_FLAGS = frozenset({
    "--model", "-m", "--host", "--port", "--alias", "-a", "--api-key", "--api-key-file", "--parent-pid",
    "--metrics", "--cors-origins", "--ctx", "--ctx-size", "-c", "--parallel", "-np", "--batch", "--batch-size",
    "-b", "--threads", "-t", "--gpu-layers", "--n-gpu-layers", "-ngl", "--mode", "--kv-unified", "--no-webui",
})
MAX_RUNNER_ARGS = 64  # arguments per model
MAX_RUNNER_ARG_CHARS = 4096


def parse_runner_args(text: str | None) -> dict[str, tuple[str, ...]]:
    """The runner_args setting read: model name → the extra command-line arguments of its local runner.

    The setting is a JSON object, e.g. {"qwen3-8b": ["--reasoning-format", "none"]}. ValueError names
    what is wrong: not an object, an argument that is not a string, too many or too long, the first not a
    flag, or a flag serve sets itself (SERVE_RUNNER_FLAGS).
    """
    if text is None or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"runner_args is JSON: an object of model name to a list of arguments ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ValueError('runner_args is an object of model name to a list of arguments, e.g. '
                         '{"my-model": ["--reasoning-format", "none"]}')
    return {name: _model_runner_args(name, args) for name, args in value.items()}


def _model_runner_args(name: str, args) -> tuple[str, ...]:
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError(f"runner_args of {name!r}: a list of strings, e.g. [\"--grammar-file\", \"/path/g.gbnf\"]")
    if len(args) > MAX_RUNNER_ARGS:
        raise ValueError(f"runner_args of {name!r}: at most {MAX_RUNNER_ARGS} arguments")
    if args and not args[0].startswith("-"):
        raise ValueError(f"runner_args of {name!r}: the first argument must be a flag (--name), not {args[0]!r}")
    for a in args:
        if len(a) > MAX_RUNNER_ARG_CHARS or "\0" in a:
            raise ValueError(f"runner_args of {name!r}: an argument has at most {MAX_RUNNER_ARG_CHARS} characters "
                             "and no NUL")
        flag = a.split("=", 1)[0]
        if flag in SERVE_RUNNER_FLAGS:
            raise ValueError(f"runner_args of {name!r}: {flag} is set by hearth serve itself (slots, cells, batch, "
                             "threads, GPU layers and mode are the model's runner settings)")
    return tuple(args)


def runner_args_problem(text: str) -> str | None:
    """What is wrong with a runner_args value, or None (the setting's check)."""
    try:
        parse_runner_args(text)
    except ValueError as exc:
        return str(exc)
    return None


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
            r = httpx.get(f"{self.url}/health", timeout=2.0, headers=self.headers)
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


# --- remote node -----------------------------------------------------------------------------

# Requests running + waiting, by the names each server family exports.
LOAD_METRICS = (
    ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
    ("vllm:num_requests_running", "vllm:num_requests_waiting"),
)


def parse_load(metrics_text: str) -> float | None:
    """Running + waiting requests from Prometheus text (llama-server or vLLM names); None if absent.

    Labelled series (vLLM labels by model and engine) add up; text that is no exposition raises ValueError.
    """
    scrape = parse_exposition(metrics_text)
    for names in LOAD_METRICS:
        values = [scrape.value(n) for n in names]
        if any(v is not None for v in values):
            return sum(v or 0.0 for v in values)
    return None


# A PEM file of the certificate authorities that sign the household's own https:// nodes (a
# self-signed certificate is its own CA). Trusted on top of the system's store; certificates and
# host names are always verified.
NODE_CA_ENV = "HEARTH_NODE_CA_FILE"


@lru_cache(maxsize=4)
def _tls_context(ca_file: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context()
    if ca_file:
        context.load_verify_locations(cafile=ca_file)
    return context


def node_tls_context() -> ssl.SSLContext:
    """The TLS settings for https:// nodes, one for probes and relay alike: system CAs plus $HEARTH_NODE_CA_FILE."""
    return _tls_context(os.environ.get(NODE_CA_ENV) or None)


class RemoteNode:
    """An OpenAI-compatible server elsewhere (llama-server, vLLM, another Hearth runner): no process."""

    def __init__(self, url: str, label: str | None = None, timeout_s: float = 2.0):
        self.url = url.rstrip("/")
        self.label = label or self.url
        self.timeout_s = timeout_s
        # Set by the last health check: the node answered 503 (loading its model, or full).
        self.busy = False
        # Routing asks for the load on every request: an unreadable /metrics is logged once per streak.
        self._metrics_unreadable = False

    def __repr__(self) -> str:
        return f"<RemoteNode {self.label} {self.url}>"

    def _get(self, path: str) -> httpx.Response:
        verify = node_tls_context() if self.url.startswith("https://") else True
        # A local runner's probe carries its key; a remote node gets none it was not given.
        return httpx.get(f"{self.url}{path}", timeout=self.timeout_s, verify=verify, headers=runner_headers(self.url))

    def healthy(self) -> bool:
        """GET /health is 200, or 503: up but loading or busy, which is no failure (`busy` says which).
        Servers without /health (404) count when /v1/models answers 200."""
        try:
            r = self._get("/health")
            if r.status_code == 404:
                r = self._get("/v1/models")
        except httpx.HTTPError:
            return False
        self.busy = r.status_code == 503
        return r.status_code in (200, 503)

    def load(self) -> float | None:
        """Requests running + waiting from /metrics; None when unknown."""
        try:
            r = self._get("/metrics")
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        try:
            load = parse_load(r.text)
        except ValueError as error:
            if not self._metrics_unreadable:
                log.warning("remote node %s: /metrics is unreadable, routing ignores its load: %s", self.label, error)
            self._metrics_unreadable = True
            return None
        self._metrics_unreadable = False
        return load
