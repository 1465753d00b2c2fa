"""llama-server's flags that `hearth runner` does not implement: each accepted with a one-line notice where ignoring it
is harmless, or refused with the reason.

Every flag the pinned llama-server's `--help` documents is either one of the runner's own options (app.runner.command)
or listed here; tests/runner/test_llama_flags.py reads the pinned binary's `--help` and fails on a flag that is
neither, so a newer pin shows what it added. A flag is harmless to ignore when the runner already does what it asks
(`--swa-full`, `--no-context-shift`), when it only tunes threads, logs or a UI a runner does not have, or when
`hearth serve` does that job for its runners (`--fit`: serve sizes a runner before it starts it). A flag that would
change answers, what is loaded or who may connect is refused, never silently dropped.
"""

from __future__ import annotations

import argparse
import sys
from typing import NamedTuple

NOTICE, REFUSED = "notice", "refused"


class LlamaFlag(NamedTuple):
    """One llama-server flag group the runner does not implement: its spellings, values, and what the runner does."""

    spellings: tuple[str, ...]
    nargs: int | str  # 0 (a switch), 1, 2 or "?" (an optional value), as llama-server parses it
    kind: str  # NOTICE or REFUSED
    reason: str


_THREADS = "thread placement, priority and polling are left to the OS (Hearth uses --threads threads)"
_LOGS = "the runner logs to stderr in its own format"
_FIT = ("hearth serve fits a runner to the free memory before it starts it (context, slots, layers); "
        "the runner takes the sizes it is given")
_SAMPLING = "server-wide sampling defaults are not supported: send this sampling field in each request"
_DOWNLOAD = ("the runner loads a local GGUF (-m); Hearth's model library pulls models (dashboard or "
             "`hearth models`)")
_ROPE = "overriding the model's RoPE settings is not supported: the GGUF's own are used"
_ADAPTERS = "LoRA adapters and control vectors are not supported"
_UI = "a runner has no web UI (hearth serve has the dashboard)"
_AGENT = "server-side tools and agents are not part of a runner: the client runs its tools"
_ROUTER = "router mode is hearth serve's job: a runner serves one model"
_DRAFT_PLACE = "the draft model runs beside the target with --spec-draft-ngl and --spec-draft-threads"
_PRESET = "presets download a model from Hugging Face; give the runner a local GGUF with -m"

FLAGS: tuple[LlamaFlag, ...] = (
    LlamaFlag(("-cl", "--cache-list"), 0, REFUSED, _DOWNLOAD),
    LlamaFlag(("--completion-bash",), 0, REFUSED, "llama.cpp's shell completion script lists llama-server's flags"),
    LlamaFlag(("-tb", "--threads-batch"), 1, NOTICE, "prompts are computed with --threads threads too"),
    *(LlamaFlag(s, n, NOTICE, _THREADS) for s, n in (
        (("-C", "--cpu-mask"), 1), (("-Cr", "--cpu-range"), 1), (("--cpu-strict",), 1), (("--prio",), 1),
        (("--poll",), 1), (("-Cb", "--cpu-mask-batch"), 1), (("-Crb", "--cpu-range-batch"), 1),
        (("--cpu-strict-batch",), 1), (("--prio-batch",), 1), (("--poll-batch",), 1),
        (("--spec-draft-cpu-mask", "-Cd", "--cpu-mask-draft"), 1),
        (("--spec-draft-cpu-range", "-Crd", "--cpu-range-draft"), 1),
        (("--spec-draft-cpu-strict", "--cpu-strict-draft"), 1), (("--spec-draft-prio", "--prio-draft"), 1),
        (("--spec-draft-poll", "--poll-draft"), 1),
        (("--spec-draft-cpu-mask-batch", "-Cbd", "--cpu-mask-batch-draft"), 1),
        (("--spec-draft-cpu-strict-batch", "--cpu-strict-batch-draft"), 1),
        (("--spec-draft-prio-batch", "--prio-batch-draft"), 1), (("--spec-draft-poll-batch", "--poll-batch-draft"), 1),
        (("--spec-draft-threads-batch", "-tbd", "--threads-batch-draft"), 1), (("--numa",), 1))),
    LlamaFlag(("--keep",), 1, NOTICE, "Hearth never shifts the context, so no prompt tokens need keeping"),
    LlamaFlag(("--swa-full",), 0, NOTICE, "Hearth's runner always keeps a full-size SWA cache"),
    LlamaFlag(("--perf", "--no-perf"), 0, NOTICE, "Hearth measures its own timings (/metrics, each answer's timings)"),
    LlamaFlag(("-e", "--escape", "--no-escape"), 0, NOTICE, "escapes apply to prompts given on llama.cpp's command "
                                                            "line; a runner takes prompts over HTTP"),
    *(LlamaFlag(s, 1, REFUSED, _ROPE) for s in (
        ("--rope-scaling",), ("--rope-scale",), ("--rope-freq-base",), ("--rope-freq-scale",), ("--yarn-orig-ctx",),
        ("--yarn-ext-factor",), ("--yarn-attn-factor",), ("--yarn-beta-slow",), ("--yarn-beta-fast",))),
    LlamaFlag(("-kvo", "--kv-offload"), 0, NOTICE, "the KV cache is offloaded with its layers already"),
    LlamaFlag(("-nkvo", "--no-kv-offload"), 0, REFUSED, "the KV cache always stays with its layers' device"),
    LlamaFlag(("--no-host",), 0, NOTICE, "llama.cpp's default host buffers are kept"),
    LlamaFlag(("-dt", "--defrag-thold"), 1, NOTICE, "deprecated in llama.cpp; Hearth's cache needs no defragmenting"),
    LlamaFlag(("--rpc",), 1, REFUSED, "llama.cpp's RPC backends are not supported: register the other box as a "
                                      "remote node of hearth serve"),
    LlamaFlag(("-lm", "--load-mode"), 1, NOTICE, "the model loads the way llama.cpp loads it by default"),
    LlamaFlag(("-lzm", "--lazy-mode"), 1, NOTICE, "the model loads the way llama.cpp loads it by default"),
    LlamaFlag(("-ncffn", "--n-cpu-ffn"), 1, REFUSED, "keep FFN tensors in RAM with -ot (e.g. ffn=CPU)"),
    LlamaFlag(("-fit", "--fit"), "?", NOTICE, _FIT),
    LlamaFlag(("-fitt", "--fit-target"), 1, NOTICE, _FIT),
    LlamaFlag(("-fitc", "--fit-ctx"), 1, NOTICE, _FIT),
    LlamaFlag(("--check-tensors",), 0, NOTICE, "Hearth checks a GGUF's header before it loads; llama.cpp still "
                                               "refuses a file it cannot read"),
    LlamaFlag(("--override-kv",), 1, REFUSED, "overriding the model's metadata is not supported"),
    LlamaFlag(("--op-offload", "--no-op-offload"), 0, NOTICE, "llama.cpp's default operation offload is kept"),
    *(LlamaFlag(s, n, REFUSED, _ADAPTERS) for s, n in (
        (("--lora",), 1), (("--lora-scaled",), 1), (("--control-vector",), 1), (("--control-vector-scaled",), 1),
        (("--control-vector-layer-range",), 2), (("--lora-init-without-apply",), 0))),
    *(LlamaFlag(s, n, REFUSED, _DOWNLOAD) for s, n in (
        (("-mu", "--model-url"), 1), (("-dr", "--docker-repo"), 1), (("-hf", "-hfr", "--hf-repo"), 1),
        (("-hff", "--hf-file"), 1), (("-hft", "--hf-token"), 1), (("--offline",), 0), (("-mmu", "--mmproj-url"), 1),
        (("--spec-draft-hf", "-hfd", "-hfrd", "--hf-repo-draft"), 1))),
    *(LlamaFlag(s, n, NOTICE, _LOGS) for s, n in (
        (("--log-disable",), 0), (("--log-file",), 1), (("--log-jsonl", "--no-log-jsonl"), 0),
        (("--log-colors",), "?"), (("-lv", "--verbosity", "--log-verbosity"), 1),
        (("--log-prefix", "--no-log-prefix"), 0), (("--log-timestamps", "--no-log-timestamps"), 0))),
    LlamaFlag(("--spec-draft-type-k", "-ctkd", "--cache-type-k-draft"), 1, NOTICE,
              "the draft model's KV cache takes the runner's --cache-type-k"),
    LlamaFlag(("--spec-draft-type-v", "-ctvd", "--cache-type-v-draft"), 1, NOTICE,
              "the draft model's KV cache takes the runner's --cache-type-v"),
    *(LlamaFlag(s, n, REFUSED, _SAMPLING) for s, n in (
        (("--samplers",), 1), (("--sampler-seq", "--sampling-seq"), 1), (("--ignore-eos",), 0), (("--top-k",), 1),
        (("--top-p",), 1), (("--min-p",), 1), (("--top-nsigma", "--top-n-sigma"), 1), (("--xtc-probability",), 1),
        (("--xtc-threshold",), 1), (("--typical", "--typical-p"), 1), (("--repeat-last-n",), 1),
        (("--repeat-penalty",), 1), (("--presence-penalty",), 1), (("--frequency-penalty",), 1),
        (("--dry-multiplier",), 1), (("--dry-base",), 1), (("--dry-allowed-length",), 1),
        (("--dry-penalty-last-n",), 1), (("--dry-sequence-breaker",), 1), (("--adaptive-target",), 1),
        (("--adaptive-decay",), 1), (("--dynatemp-range",), 1), (("--dynatemp-exp",), 1), (("--mirostat",), 1),
        (("--mirostat-lr",), 1), (("--mirostat-ent",), 1), (("-l", "--logit-bias"), 1))),
    LlamaFlag(("-j", "--json-schema"), 1, REFUSED, "give a default constraint with --grammar or --grammar-file, or "
                                                   "json_schema in each request"),
    LlamaFlag(("-jf", "--json-schema-file"), 1, REFUSED, "give a default constraint with --grammar or "
                                                         "--grammar-file, or json_schema in each request"),
    LlamaFlag(("-bs", "--backend-sampling"), 0, NOTICE, "Hearth samples on the CPU, as llama.cpp does by default"),
    *(LlamaFlag(s, n, REFUSED, _DRAFT_PLACE) for s, n in (
        (("--spec-draft-override-tensor", "-otd", "--override-tensor-draft"), 1),
        (("--spec-draft-cpu-moe", "-cmoed", "--cpu-moe-draft"), 0),
        (("--spec-draft-n-cpu-moe", "--spec-draft-ncmoe", "-ncmoed", "--n-cpu-moe-draft"), 1),
        (("--spec-draft-device", "-devd", "--device-draft"), 1))),
    LlamaFlag(("--spec-synth-len",), 1, REFUSED, "synthetic drafts are not supported: pick a real --spec-type"),
    LlamaFlag(("--spec-synth-rates",), 1, REFUSED, "synthetic drafts are not supported: pick a real --spec-type"),
    LlamaFlag(("--spec-draft-p-split", "--draft-p-split"), 1, REFUSED, "draft trees are not supported"),
    LlamaFlag(("--spec-draft-backend-sampling", "--no-spec-draft-backend-sampling"), 0, NOTICE,
              "the draft model samples on the CPU"),
    *(LlamaFlag((f"--spec-ngram-{k}",), 1, REFUSED, "give the n-gram sizes per type: --spec-ngram-simple-size-n, "
                                                      "--spec-ngram-map-k-size-n, …")
      for k in ("size-n", "size-m", "min-hits")),
    LlamaFlag(("-lcs", "--lookup-cache-static"), 1, REFUSED, "n-gram lookup caches on disk are not supported"),
    LlamaFlag(("-lcd", "--lookup-cache-dynamic"), 1, REFUSED, "n-gram lookup caches on disk are not supported"),
    LlamaFlag(("--kv-unified-per-slot",), 1, REFUSED, "Hearth's runner keeps one unified KV cache for all slots"),
    LlamaFlag(("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"), 1, NOTICE,
              "a full-size SWA cache needs no checkpoints"),
    LlamaFlag(("-cms", "--checkpoint-min-step"), 1, NOTICE, "a full-size SWA cache needs no checkpoints"),
    LlamaFlag(("-no-kvu", "--no-kv-unified"), 0, REFUSED, "Hearth's runner keeps one unified KV cache for all slots"),
    LlamaFlag(("--cache-idle-slots", "--no-cache-idle-slots"), 0, NOTICE,
              "the prefix cache keeps idle prefixes in free KV space (--prefix-cache, --cache-ram)"),
    LlamaFlag(("--no-context-shift",), 0, NOTICE, "Hearth never shifts the context"),
    LlamaFlag(("--context-shift",), 0, REFUSED, "Hearth never shifts the context: an answer stops when the "
                                                "context is full (finish_reason length)"),
    LlamaFlag(("-r", "--reverse-prompt"), 1, REFUSED, "give stop strings in each request (stop)"),
    LlamaFlag(("-sp", "--special"), 0, REFUSED, "special tokens are rendered as each model family's answer parser "
                                                "needs them"),
    LlamaFlag(("--warmup", "--no-warmup"), 0, NOTICE, "the runner's load does its own first decode"),
    LlamaFlag(("--spm-infill",), 0, REFUSED, "infill prompts keep the model's own order of prefix and suffix"),
    LlamaFlag(("--mmproj-auto", "--no-mmproj-auto"), 0, NOTICE,
              "a projector is used only when --mmproj names it (hearth serve finds it beside the model)"),
    LlamaFlag(("--mmproj-offload", "--no-mmproj-offload"), 0, NOTICE, "the projector goes where libmtmd puts it"),
    LlamaFlag(("-mmdev", "--mmproj-device"), 1, NOTICE, "the projector goes where libmtmd puts it"),
    LlamaFlag(("--image-min-tokens",), 1, REFUSED, "an image takes the tokens its projector gives it"),
    LlamaFlag(("--image-max-tokens",), 1, REFUSED, "an image takes the tokens its projector gives it (bound images "
                                                   "with --image-max-pixels)"),
    LlamaFlag(("--mtmd-batch-max-tokens",), 1, NOTICE, "media are decoded in --batch-size chunks"),
    *(LlamaFlag((f,), 1, REFUSED, "video input is not supported")
      for f in ("--video-fps", "--video-timestamp-interval", "--video-ffmpeg-dir")),
    LlamaFlag(("--embd-normalize",), 1, REFUSED, "embeddings are L2-normalised, as OpenAI's"),
    LlamaFlag(("--reuse-port",), 0, NOTICE, "one runner listens on its port"),
    LlamaFlag(("--path",), 1, NOTICE, _UI),
    LlamaFlag(("--api-prefix",), 1, REFUSED, "the runner's routes are at the root, where hearth serve expects them"),
    LlamaFlag(("--cors-methods",), 1, NOTICE, "CORS answers follow --cors-origins"),
    LlamaFlag(("--cors-headers",), 1, NOTICE, "CORS answers follow --cors-origins"),
    LlamaFlag(("--cors-credentials", "--no-cors-credentials"), 0, NOTICE, "CORS answers follow --cors-origins"),
    LlamaFlag(("--ui-config", "--webui-config"), 1, NOTICE, _UI),
    LlamaFlag(("--ui-config-file", "--webui-config-file"), 1, NOTICE, _UI),
    LlamaFlag(("--ui-mcp-proxy", "--webui-mcp-proxy", "--no-ui-mcp-proxy", "--no-webui-mcp-proxy"), 0, NOTICE, _UI),
    LlamaFlag(("--ui", "--webui", "--no-ui", "--no-webui"), 0, NOTICE, _UI),
    LlamaFlag(("--tools",), 1, REFUSED, _AGENT),
    LlamaFlag(("--tools-runtime",), 1, REFUSED, _AGENT),
    LlamaFlag(("--mcp-servers-config",), 1, REFUSED, _AGENT),
    LlamaFlag(("--mcp-servers-json",), 1, REFUSED, _AGENT),
    LlamaFlag(("-ag", "--agent", "-no-ag", "--no-agent"), 0, REFUSED, _AGENT),
    LlamaFlag(("--api-key-file",), 1, REFUSED, "give keys with --api-key or $HEARTH_RUNNER_API_KEY"),
    LlamaFlag(("--ssl-key-file",), 1, REFUSED, "TLS is not served by a runner: put a TLS proxy before hearth serve"),
    LlamaFlag(("--ssl-cert-file",), 1, REFUSED, "TLS is not served by a runner: put a TLS proxy before hearth serve"),
    LlamaFlag(("--chat-template-kwargs",), 1, REFUSED, "send chat_template_kwargs in each request"),
    LlamaFlag(("-to", "--timeout"), 1, NOTICE, "hearth serve guards its clients' time-outs; the runner reads and "
                                               "writes on loopback"),
    LlamaFlag(("--sse-ping-interval",), 1, NOTICE, "hearth serve keeps its clients' streams alive"),
    LlamaFlag(("--threads-http",), 1, NOTICE, "the runner's HTTP server needs no thread per connection"),
    LlamaFlag(("--cache-prompt",), 0, NOTICE, "prompt caching is on by default (--prefix-cache)"),
    LlamaFlag(("--props",), 0, NOTICE, "the runner's settings are fixed at start: POST /props is refused"),
    LlamaFlag(("--slot-save-path",), 1, REFUSED, "slots are not saved to files; --cache-disk keeps prefixes on disk"),
    LlamaFlag(("--media-path",), 1, REFUSED, "media come in the request (data URLs, or URLs with --image-url-fetch)"),
    LlamaFlag(("--models-dir",), 1, REFUSED, _ROUTER),
    LlamaFlag(("--models-preset",), 1, REFUSED, _ROUTER),
    LlamaFlag(("--models-max",), 1, REFUSED, _ROUTER),
    LlamaFlag(("--models-autoload", "--no-models-autoload"), 0, REFUSED, _ROUTER),
    LlamaFlag(("--reasoning-effort",), 1, REFUSED, "send reasoning_effort in each request"),
    LlamaFlag(("--reasoning-preserve", "--no-reasoning-preserve"), 0, REFUSED,
              "earlier turns' reasoning reaches the template as each request sends it"),
    LlamaFlag(("--skip-chat-parsing", "--no-skip-chat-parsing"), 0, REFUSED,
              "answers are always split into reasoning, content and calls (reasoning_format none keeps thoughts in "
              "content)"),
    LlamaFlag(("--prefill-assistant",), 0, NOTICE, "a final assistant message is continued by default"),
    LlamaFlag(("--no-prefill-assistant",), 0, REFUSED, "a final assistant message is always continued"),
    LlamaFlag(("-sps", "--slot-prompt-similarity"), 1, NOTICE, "requests find their cached prefix in the prefix "
                                                               "cache, whatever slot they get"),
    LlamaFlag(("--sleep-idle-seconds",), 1, NOTICE, "hearth serve unloads idle runners (keep-alive)"),
    LlamaFlag(("--log-prompts-dir",), 1, REFUSED, "Hearth never writes the household's prompts to files"),
    *(LlamaFlag((f,), 0, REFUSED, _PRESET) for f in (
        "--embd-gemma-default", "--fim-qwen-1.5b-default", "--fim-qwen-3b-default", "--fim-qwen-7b-default",
        "--fim-qwen-7b-spec", "--fim-qwen-14b-spec", "--fim-qwen-30b-default", "--gpt-oss-20b-default",
        "--gpt-oss-120b-default", "--vision-gemma-4b-default", "--vision-gemma-12b-default", "--spec-default")),
)


class _Notice(argparse.Action):
    """Accepts the flag (and its value) and records the one-line notice the runner prints at start."""

    def __init__(self, option_strings, dest, reason: str = "", **kwargs):
        self.reason = reason
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        notices = list(getattr(namespace, self.dest, None) or [])
        notices.append(f"hearth runner: {option_string} accepted and ignored: {self.reason}")
        setattr(namespace, self.dest, notices)


class _Refused(argparse.Action):
    """Refuses the flag with its reason (exit status 2, as an unknown flag)."""

    def __init__(self, option_strings, dest, reason: str = "", **kwargs):
        self.reason = reason
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is not supported: {self.reason}")


def add_llama_flags(p: argparse.ArgumentParser) -> None:
    """Register every flag of FLAGS on the runner's parser: notices gather in `llama_notices`."""
    g = p.add_argument_group("llama-server's flags accepted with a notice, or refused with the reason")
    p.set_defaults(llama_notices=[])
    for flag in FLAGS:
        action = _Notice if flag.kind == NOTICE else _Refused
        nargs = {0: 0, 1: None, 2: 2, "?": "?"}[flag.nargs]
        g.add_argument(*flag.spellings, dest="llama_notices", action=action, nargs=nargs, reason=flag.reason,
                       help=f"{'ignored' if flag.kind == NOTICE else 'refused'}: {flag.reason}")


def print_notices(args) -> None:
    """The notices of the ignored flags a command line gave, one line each on stderr."""
    for line in dict.fromkeys(getattr(args, "llama_notices", None) or []):
        print(line, file=sys.stderr)
