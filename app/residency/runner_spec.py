"""How a model's local runner is started: RunnerSpec (its command line), the speculation setting, runner_args."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from app.engine.kv_tiers import DEFAULT_CACHE_DISK_MAX_AGE_H, DEFAULT_CACHE_DISK_MIB, DEFAULT_CACHE_RAM_MIB
from app.engine.kv_types import DEFAULT_KV_TYPE, KV_TYPE_BYTES
from app.engine.speculation import NGRAM_TYPES, SpecConfig
from app.hardware import usable_cores
from app.policy import RUNNER_KINDS, RunnerKind
from app.repack import repack_works

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
            # The rule the hearth runner follows, asked of this binary's build: where its AMX repack path dies
            # (a Xeon VM whose CPUID lists AMX), repack is off; where it runs, it stays on (app.repack).
            if not repack_works(self.binary_path):
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
