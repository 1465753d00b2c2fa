"""`hearth runner`'s command line: llama-server's flags, and the runner's config built from them."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from app.engine.kv_types import DEFAULT_KV_TYPE, KV_TYPES, kv_type_problem
from app.hardware import usable_cores
from app.llama_tools import pinned_llama_cpp_version
from app.policy import Mode
from app.runner.config import ImageLimits
from app.runner.llama_flags import add_llama_flags, print_notices


def resolve_model(path: str | None) -> str:
    """The given GGUF path, or the embedded default model assembled into the data folder."""
    if path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise SystemExit(f"hearth: model file not found: {p}")
        return str(p)
    from app.paths import data_dir
    from app.residency.default_model import ensure_default_model

    return str(ensure_default_model(data_dir(), progress=True))


def model_config(args, path: str, **overrides):
    """The llama.cpp settings given by the shared model arguments."""
    from app.engine.model_config import ModelConfig

    return ModelConfig(
        **{
            "path": path,
            "n_ctx": args.ctx,
            "n_seq_max": args.parallel,
            "n_batch": args.batch,
            "n_threads": args.threads,
            "n_gpu_layers": args.gpu_layers,
            "repack": args.repack,
            **overrides,
        }
    )

def _add_model_args(p: argparse.ArgumentParser, ctx: int, parallel: int) -> None:
    # The short and long spellings after Hearth's own are llama-server's, so its command lines work here.
    p.add_argument("--model", "-m", help="GGUF file (default: the embedded Gemma 3 270M Q4_K_M)")
    p.add_argument("--ctx", "-c", "--ctx-size", dest="ctx", type=int, default=ctx,
                   help="KV cache cells shared by all sequences (default %(default)s)")
    p.add_argument("--parallel", "-np", type=int, default=parallel, help="sequence slots (default %(default)s)")
    p.add_argument("--batch", "-b", "--batch-size", dest="batch", type=int, default=512,
                   help="n_batch: max tokens per llama_decode (default %(default)s)")
    p.add_argument("--budget", type=int, default=None, help="tokens per iteration (default: --batch)")
    p.add_argument("--threads", "-t", type=int, default=usable_cores(), help="CPU threads (default %(default)s)")
    p.add_argument("--gpu-layers", "-ngl", "--n-gpu-layers", dest="gpu_layers", type=int, default=0,
                   help="layers offloaded to the GPU (default %(default)s)")
    p.add_argument("--repack", action=argparse.BooleanOptionalAction, default=None,
                   help="llama.cpp weight repacking (default: on unless this build's repack path dies on this CPU, "
                        "as app.repack's probe finds once per build and CPU)")


POOLINGS = ("none", "mean", "cls", "last", "rank")


def _add_llama_server_args(p: argparse.ArgumentParser) -> None:
    """llama-server's flags that `hearth runner` honours, so it can stand in for the binary."""
    # In the order llama-server's flags were added, which is the order of the usage line; the groups' order is
    # the order of --help's sections.
    g = p.add_argument_group("llama-server's flags")
    _add_batch_and_kv_args(g)
    _add_placement_args(p.add_argument_group("placement: experts, tensors, several GPUs (llama-server's flags)"))
    _add_serving_args(g)
    _add_image_args(p.add_argument_group("images (llama-server's --mmproj)"))
    _add_speculation_args(p.add_argument_group("speculative decoding (llama-server's --spec-* flags)"))
    g.add_argument("--verbose", "-v", "--log-verbose", dest="runner_verbose", action="store_true",
                   help="more logging, and llama-server's __verbose object (the rendered prompt) in chat answers")
    g.add_argument("--cors-origins", default="*",
                   help="CORS origins answered (default %(default)s, as llama-server; 'localhost' for loopback only, "
                        "'none' for no CORS at all, as `hearth serve` starts its runners)")


def _add_batch_and_kv_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("-ub", "--ubatch-size", dest="ubatch", type=int, default=None,
                   help="n_ubatch: tokens per physical batch (default: min(--batch, 512))")
    g.add_argument("-fa", "--flash-attn", dest="flash_attn", choices=("on", "off", "auto"), default="auto",
                   help="flash attention (default %(default)s: llama.cpp decides)")
    g.add_argument("-ctk", "--cache-type-k", dest="cache_type_k", choices=KV_TYPES, default=DEFAULT_KV_TYPE,
                   help="KV cache type of K (default %(default)s; q8_0 takes 17/32 of f16's bytes)")
    g.add_argument("-ctv", "--cache-type-v", dest="cache_type_v", choices=KV_TYPES, default=DEFAULT_KV_TYPE,
                   help="KV cache type of V (default %(default)s; a quantized V needs flash attention)")


def _add_placement_args(pl: argparse._ArgumentGroup) -> None:
    pl.add_argument("-cmoe", "--cpu-moe", dest="cpu_moe", action="store_true",
                    help="keep every Mixture-of-Experts layer's experts in RAM")
    pl.add_argument("-ncmoe", "--n-cpu-moe", dest="n_cpu_moe", type=int, default=0,
                    help="keep the experts of the first N layers in RAM (default %(default)s)")
    pl.add_argument("-ot", "--override-tensor", dest="override_tensor", action="append", default=[],
                    help="<tensor name pattern>=<buffer type>,...: where matching tensors go (e.g. exps=CPU)")
    pl.add_argument("-dev", "--device", dest="device", default=None,
                    help="comma-separated devices to offload to (e.g. Vulkan0,Vulkan1; none: no offload)")
    pl.add_argument("-ts", "--tensor-split", dest="tensor_split", default=None,
                    help="shares of the offloaded layers per device, e.g. 3,1 (default: by free memory)")
    pl.add_argument("-sm", "--split-mode", dest="split_mode", choices=("none", "layer", "row"), default="layer",
                    help="how layers are split over several GPUs (default %(default)s)")
    pl.add_argument("-mg", "--main-gpu", dest="main_gpu", type=int, default=0,
                    help="the GPU of the whole model with --split-mode none (default %(default)s)")


def _add_serving_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int, default=-1,
                   help="tokens to generate when a request names no limit (-1: until the context is full)")
    g.add_argument("--temp", "--temperature", dest="temp", type=float, default=None, help="sampling temperature when a request names none")
    g.add_argument("--seed", "-s", dest="seed", type=int, default=None, help="sampling seed when a request names none (-1: random)")
    g.add_argument("--api-key", action="append", default=[],
                   help="API key(s) clients must send as a bearer token or X-Api-Key (comma-separated or repeated); "
                        "also read from $HEARTH_RUNNER_API_KEY, where `hearth serve` puts its runners' keys")
    g.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=False,
                   help="serve /metrics (default: off, as llama-server; `hearth serve` starts its runners with it)")
    g.add_argument("--slots", action=argparse.BooleanOptionalAction, default=True, help="serve /slots (default: on)")
    g.add_argument("--jinja", action=argparse.BooleanOptionalAction, default=True,
                   help="accepted for llama-server's command lines: Hearth always renders Jinja chat templates")
    g.add_argument("--chat-template", help="Jinja chat template text, instead of the model's own")
    g.add_argument("--chat-template-file", help="file with a Jinja chat template, instead of the model's own")
    g.add_argument("--embedding", "--embeddings", dest="embedding", action="store_true",
                   help="embedding mode: /v1/embeddings and /embeddings")
    g.add_argument("--pooling", choices=POOLINGS, default=None, help="embedding pooling (default: the model's)")
    g.add_argument("--reranking", "--rerank", dest="reranking", action="store_true", help="reranking mode: /rerank")
    g.add_argument("-kvu", "--kv-unified", action="store_true",
                   help="accepted for llama-server's command lines: Hearth's KV cache is always unified")
    g.add_argument("--cache-reuse", type=int, default=0,
                   help="only 0 is accepted: Hearth reuses shared prefixes (--prefix-cache), not shifted chunks")
    g.add_argument("-cram", "--cache-ram", dest="cache_ram", type=int, default=None,
                   help="host RAM in MiB for prefix-cache entries evicted from the KV cache, restored on a later "
                        "hit: -1 no limit, 0 off (default 2048, a quarter of llama-server's 8192: a NAS shares its "
                        "RAM with the weights)")
    g.add_argument("--cache-disk", default=None,
                   help="Hearth: folder where cached prefixes are written so they survive restarts and model swaps, "
                        "keyed by the model file, its template and the KV settings (default: off)")
    g.add_argument("--cache-disk-mib", type=int, default=None,
                   help="Hearth: disk budget of --cache-disk in MiB, -1 no limit (default 4096)")
    g.add_argument("--cache-disk-max-age-h", type=float, default=None,
                   help="Hearth: an entry of --cache-disk not used for this many hours is deleted, 0 never "
                        "(default 72: the words of a conversation do not lie on disk for good)")
    g.add_argument("-cb", "--cont-batching", dest="cont_batching", action=argparse.BooleanOptionalAction,
                   default=None, help="--no-cont-batching is --mode serial")
    g.add_argument("-nocb", dest="cont_batching", action="store_false", help="--no-cont-batching's short spelling")
    g.add_argument("--reasoning", "-rea", dest="reasoning", choices=("on", "off", "auto"), default="auto",
                   help="thinking in templates that have it: off sets enable_thinking false (default %(default)s: on)")
    g.add_argument("--reasoning-format", choices=("none", "auto", "deepseek", "deepseek-legacy"), default="auto",
                   help="where thoughts go: 'none' leaves them in content verbatim; the others put them in "
                        "reasoning_content (default %(default)s)")
    g.add_argument("--reasoning-budget", type=int, default=-1,
                   help="thinking tokens a request may use when it names none: -1 unlimited, 0 no thinking "
                        "(default %(default)s)")
    g.add_argument("--reasoning-budget-message", default="",
                   help="text forced before the end of a thought when its budget is spent (default: none)")
    g.add_argument("--grammar", default=None, help="GBNF for requests that bring no constraint of their own")
    g.add_argument("--grammar-file", default=None,
                   help="file with a GBNF for requests that bring no constraint of their own")
    g.add_argument("--tags", default="", help="comma-separated tags listed on /models")


def _add_image_args(mm: argparse._ArgumentGroup) -> None:
    mm.add_argument("-mm", "--mmproj", default=None,
                    help="the model's multimodal projector (an mmproj GGUF): the model then takes images")
    mm.add_argument("--no-mmproj", action="store_true", help="no projector, even when --mmproj is given: text only")
    mm.add_argument("--image-max-bytes", type=int, default=ImageLimits.max_bytes,
                    help="largest image a request may send, in bytes (default %(default)s)")
    mm.add_argument("--image-max-pixels", type=int, default=ImageLimits.max_pixels,
                    help="largest image a request may send, in pixels (default %(default)s)")
    mm.add_argument("--image-max-request-pixels", type=int, default=ImageLimits.max_request_pixels,
                    help="Hearth: pixels a request's images may decode to, all together, after a JPEG's reduction on "
                         "decode (default %(default)s)")
    mm.add_argument("--image-url-fetch", action="store_true",
                    help="fetch http(s) image URLs named in requests (default: off, only data URLs are taken); public "
                         "addresses only, unless --image-url-hosts allows a LAN host")
    mm.add_argument("--image-url-hosts", default="",
                    help="hosts an image URL may reach although they are on the LAN or this machine: names, addresses or "
                         "networks, comma-separated (default: none)")
    mm.add_argument("--image-url-timeout", type=float, default=ImageLimits.fetch_timeout_s,
                    help="seconds a whole image fetch may take (default %(default)s)")


def _add_speculation_args(sp: argparse._ArgumentGroup) -> None:
    sp.add_argument("--spec-type", default="none",
                    help="draft source: none, ngram-lookup (Hearth's), ngram-simple, ngram-map-k, ngram-map-k4v, "
                         "ngram-mod, draft-simple (a draft model, -md) (default %(default)s)")
    sp.add_argument("--spec-draft-n-max", "--draft", "--draft-n", "--draft-max", dest="spec_n_max", type=int,
                    default=None, help="draft tokens per sequence per iteration at most (default: the type's own)")
    sp.add_argument("--spec-draft-n-min", "--draft-min", "--draft-n-min", dest="spec_n_min", type=int, default=0,
                    help="shorter drafts are not verified (default %(default)s)")
    sp.add_argument("--spec-draft-model", "-md", "--model-draft", dest="spec_draft_model", default=None,
                    help="draft model for --spec-type draft-simple: a smaller GGUF of the same vocabulary (without "
                         "--spec-type draft-simple it is not used, as llama-server)")
    sp.add_argument("--spec-draft-p-min", "--draft-p-min", dest="spec_p_min", type=float, default=0.0,
                    help="draft-simple: a draft stops at a token the draft model gives a lower probability "
                         "(default %(default)s)")
    sp.add_argument("--spec-draft-ngl", "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", dest="spec_draft_ngl",
                    default="auto", help="draft model layers on the GPU: a number, 'all', or 'auto' (the target's "
                                         "--gpu-layers) (default %(default)s)")
    sp.add_argument("--spec-draft-threads", "-td", "--threads-draft", dest="spec_draft_threads", type=int,
                    default=None, help="the draft model's CPU threads (default: --threads)")
    sp.add_argument("--spec-draft-by-cost", dest="spec_draft_by_cost", action=argparse.BooleanOptionalAction,
                    default=True, help="Hearth: the draft model drafts only while its measured costs say a draft "
                                       "pays; --no-spec-draft-by-cost drafts every iteration up to "
                                       "--spec-draft-n-max, as llama-server (default: on)")
    for kind in ("simple", "map-k", "map-k4v"):
        dest = kind.replace("-", "_")
        sp.add_argument(f"--spec-ngram-{kind}-size-n", dest=f"spec_{dest}_size_n", type=int, default=12,
                        help=f"ngram-{kind}: lookup length (default %(default)s)")
        sp.add_argument(f"--spec-ngram-{kind}-size-m", dest=f"spec_{dest}_size_m", type=int, default=48,
                        help=f"ngram-{kind}: draft length (default %(default)s)")
        sp.add_argument(f"--spec-ngram-{kind}-min-hits", dest=f"spec_{dest}_min_hits", type=int, default=1,
                        help=f"ngram-{kind}: times the key was seen before it drafts (default %(default)s)")
    sp.add_argument("--spec-ngram-mod-n-match", dest="spec_mod_n_match", type=int, default=24,
                    help="ngram-mod: tokens hashed (default %(default)s)")
    sp.add_argument("--spec-ngram-mod-n-min", dest="spec_mod_n_min", type=int, default=48,
                    help="ngram-mod: shortest draft (default %(default)s)")
    sp.add_argument("--spec-ngram-mod-n-max", dest="spec_mod_n_max", type=int, default=64,
                    help="ngram-mod: longest draft (default %(default)s)")
    sp.add_argument("--spec-max-seqs", dest="spec_max_seqs", type=int, default=4,
                    help="Hearth: drafting stands aside while more sequences decode at once (default %(default)s)")


def _add_runner(sub: argparse._SubParsersAction) -> None:
    """`hearth runner`: one model over loopback HTTP, llama-server's flags."""
    # No abbreviations: llama-server's flags are matched whole, so an unknown one is refused, never guessed.
    runner = sub.add_parser("runner", help="serve one model over loopback HTTP (llama-server's protocol)",
                            allow_abbrev=False)
    _add_model_args(runner, ctx=4096, parallel=4)
    runner.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.CONTINUOUS.value)
    runner.add_argument("--host", default="127.0.0.1", help="bind address (default %(default)s: loopback)")
    runner.add_argument("--port", type=int, default=8081)
    runner.add_argument("--max-waiting", type=int, default=64, help="queue length before 503 (default %(default)s)")
    runner.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV cells of shared prompt prefixes (default: on)")
    runner.add_argument("-a", "--alias", help="model name reported to clients (default: file name)")
    runner.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process is gone (set by `hearth serve` for its runners)")
    runner.add_argument("--list-devices", action="store_true",
                        help="print the devices this runner's llama.cpp build sees and exit (llama-server's flag)")
    _add_llama_server_args(runner)
    # llama-server's spellings of the runner's own switches, then every other flag its --help documents.
    runner.add_argument("--usage", action="help", help="the same as --help")
    runner.add_argument("--version", action="version",
                        version=f"hearth runner (llama.cpp of llama-cpp-python {pinned_llama_cpp_version()})")
    runner.add_argument("-nr", dest="repack", action="store_false", help="--no-repack's short spelling")
    runner.add_argument("--no-cache-prompt", dest="prefix_cache", action="store_false",
                        help="llama-server's spelling of --no-prefix-cache")
    add_llama_flags(runner)


def _default_grammar(args) -> str | None:
    """The runner's default GBNF (--grammar or --grammar-file), refused at start when llama.cpp could not use it."""
    from app.engine.grammar import GrammarTooLarge, InvalidGrammar, client_grammar

    if args.grammar and args.grammar_file:
        raise SystemExit("hearth runner: give --grammar or --grammar-file, not both")
    text = args.grammar
    if args.grammar_file:
        try:
            text = Path(args.grammar_file).read_text()
        except OSError as exc:
            raise SystemExit(f"hearth runner: cannot read --grammar-file: {exc}")
    if text is None:
        return None
    try:
        client_grammar(text)
    except (InvalidGrammar, GrammarTooLarge) as exc:
        raise SystemExit(f"hearth runner: the default grammar is refused: {exc}")
    return text


def spec_config(args):
    """The runner's speculative decoding settings from llama-server's --spec-* flags (SystemExit names a bad one)."""
    from app.engine.speculation import DRAFT_MODEL_TYPES, SpecConfig

    kind = args.spec_type
    if kind in DRAFT_MODEL_TYPES and not args.spec_draft_model:
        raise SystemExit(f"hearth runner: --spec-type {kind} needs a draft model: -md FILE (a smaller GGUF of the "
                         "same vocabulary)")
    if args.spec_draft_model and kind not in DRAFT_MODEL_TYPES:
        # llama-server (this llama.cpp) loads such a draft model and never drafts with it: Hearth does not load it.
        print(f"hearth runner: -md {args.spec_draft_model} is not used without --spec-type draft-simple "
              f"(--spec-type is {kind})", file=sys.stderr)
    sizes = {"ngram-map-k": "map_k", "ngram-map-k4v": "map_k4v"}.get(kind, "simple")
    try:
        return SpecConfig(
            type=kind, n_max=args.spec_n_max, n_min=args.spec_n_min,
            ngram_size_n=getattr(args, f"spec_{sizes}_size_n"), ngram_size_m=getattr(args, f"spec_{sizes}_size_m"),
            ngram_min_hits=getattr(args, f"spec_{sizes}_min_hits"), mod_n_match=args.spec_mod_n_match,
            mod_n_min=args.spec_mod_n_min, mod_n_max=args.spec_mod_n_max, max_seqs=args.spec_max_seqs,
            p_min=args.spec_p_min, draft_by_cost=args.spec_draft_by_cost,
        )
    except ValueError as exc:
        raise SystemExit(f"hearth runner: {exc}")


def placement_config(args) -> dict:
    """ModelConfig's placement settings from llama-server's -ot, --cpu-moe, --n-cpu-moe, --device, --tensor-split,
    --split-mode and --main-gpu (SystemExit names a bad one). Rules keep llama-server's order within each flag:
    -ot's first, then the experts' (the first rule a tensor matches wins)."""
    from app.residency.placement import moe_overrides, parse_overrides

    try:
        rules = [r for text in args.override_tensor for r in parse_overrides(text)]
        rules += moe_overrides(args.cpu_moe, args.n_cpu_moe)
        split = tuple(float(x) for x in args.tensor_split.split(",")) if args.tensor_split else ()
    except ValueError as exc:
        raise SystemExit(f"hearth runner: {exc}")
    if any(x < 0 for x in split):
        raise SystemExit("hearth runner: --tensor-split takes shares of 0 or more, e.g. 3,1")
    if args.main_gpu < 0:
        raise SystemExit("hearth runner: --main-gpu is a GPU's index, 0 or more")
    devices = tuple(d.strip() for d in args.device.split(",") if d.strip()) if args.device else ()
    return {"tensor_overrides": tuple((r.pattern, r.target) for r in rules), "devices": devices,
            "tensor_split": split, "split_mode": args.split_mode, "main_gpu": args.main_gpu}


def draft_model_config(args, spec):
    """The draft model's load settings (-md, -ngld, -td): the target's slots, cells and batch; None without one."""
    if not spec.uses_draft_model or not spec.enabled:
        return None
    ngl = args.spec_draft_ngl
    if ngl == "auto":
        layers = args.gpu_layers
    elif ngl == "all":
        layers = 999
    else:
        try:
            layers = int(ngl)
        except ValueError:
            raise SystemExit(f"hearth runner: --spec-draft-ngl takes a number, 'auto' or 'all', not {ngl!r}")
    if args.spec_draft_threads is not None and args.spec_draft_threads < 1:
        raise SystemExit("hearth runner: --spec-draft-threads must be at least 1")
    return model_config(args, _existing(args.spec_draft_model, "--spec-draft-model"), n_gpu_layers=layers,
                        n_threads=args.spec_draft_threads or args.threads, n_ubatch=args.ubatch,
                        flash_attn=args.flash_attn)


def _existing(path: str, flag: str) -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise SystemExit(f"hearth runner: {flag}: file not found: {p}")
    return str(p)


def _runner(args) -> int:
    """`hearth runner`: check llama-server's flags, build the runner's config from them and serve it."""
    from app.llama_tools import LlamaToolsNotFound, apply_llama_lib_env

    # Before anything imports llama_cpp: it opens the build's libraries once, at import.
    try:
        apply_llama_lib_env()
    except LlamaToolsNotFound as exc:
        raise SystemExit(f"hearth runner: {exc}")
    if args.list_devices:
        return _list_devices()
    from app.runner.main import serve

    _check_sizes(args)
    template = _chat_template(args)
    if args.reasoning_budget < -1:
        raise SystemExit("hearth runner: --reasoning-budget must be -1 (unlimited), 0 (no thinking) or a token count")
    kv_problem = kv_type_problem(args.cache_type_k, args.cache_type_v, args.flash_attn)
    if kv_problem:
        raise SystemExit(f"hearth runner: {kv_problem}")
    placement = placement_config(args)
    grammar = _default_grammar(args)
    spec = spec_config(args)
    tiers = _kv_tiers(args)
    if args.runner_verbose:
        logging.getLogger().setLevel(logging.INFO)
    config = _runner_config(args, template, placement, grammar, spec, tiers)
    print_notices(args)
    print(f"hearth runner: {config.model_name} on http://{args.host}:{args.port} "
          f"(mode {config.mode}, ctx {args.ctx}, parallel {args.parallel})", file=sys.stderr, flush=True)
    serve(config, host=args.host, port=args.port, parent_pid=args.parent_pid)
    return 0


def _list_devices() -> int:
    """--list-devices: llama-server's format, the devices layers can go to (not the CPU), total and free MiB."""
    from app.engine.backends import list_devices

    offload = [d for d in list_devices() if d.kind != "cpu"]
    print("Available devices:")
    for d in offload:
        print(f"  {d.name}: {d.description} ({d.total_bytes >> 20} MiB, {d.free_bytes >> 20} MiB free)")
    if not offload:
        print("  (none)")
    return 0


def _check_sizes(args) -> None:
    """Refuse slots, cells, batches and token limits that cannot work, and llama-server's --cache-reuse."""
    if args.parallel < 1 or args.ctx < 16 or args.batch < args.parallel:
        raise SystemExit("hearth runner: need --parallel ≥ 1, --ctx ≥ 16 and --batch ≥ --parallel")
    if args.cache_reuse:
        raise SystemExit("hearth runner: --cache-reuse is not supported (Hearth shares prompt prefixes through "
                         "its prefix cache, --prefix-cache, but does not shift reused chunks); drop the flag")
    if args.ubatch is not None and not 1 <= args.ubatch <= args.batch:
        raise SystemExit("hearth runner: need 1 ≤ --ubatch-size ≤ --batch-size")
    if args.n_predict == 0 or args.n_predict < -1:
        raise SystemExit("hearth runner: --n-predict must be -1 (no limit) or a positive number of tokens")


def _chat_template(args) -> str | None:
    """The chat template given by --chat-template (Jinja text or a known name) or --chat-template-file; None: the model's."""
    from app.engine.named_template import NamedTemplate, is_template_name

    if args.chat_template and args.chat_template_file:
        raise SystemExit("hearth runner: give --chat-template or --chat-template-file, not both")
    template = args.chat_template
    if template and is_template_name(template):
        try:
            NamedTemplate(template, "", "")
        except ValueError as exc:
            raise SystemExit(f"hearth runner: --chat-template: {exc}; pass Jinja text or --chat-template-file")
    if args.chat_template_file:
        try:
            template = Path(args.chat_template_file).read_text()
        except OSError as exc:
            raise SystemExit(f"hearth runner: cannot read --chat-template-file: {exc}")
    return template


def _kv_tiers(args) -> tuple[int, int, float]:
    """The KV tiers' --cache-ram MiB, --cache-disk-mib and --cache-disk-max-age-h, defaults filled in and checked."""
    from app.engine.kv_tiers import (
        DEFAULT_CACHE_DISK_MAX_AGE_H,
        DEFAULT_CACHE_DISK_MIB,
        DEFAULT_CACHE_RAM_MIB,
        cache_ram_bytes,
    )

    cache_ram = DEFAULT_CACHE_RAM_MIB if args.cache_ram is None else args.cache_ram
    cache_disk_mib = DEFAULT_CACHE_DISK_MIB if args.cache_disk_mib is None else args.cache_disk_mib
    max_age_h = DEFAULT_CACHE_DISK_MAX_AGE_H if args.cache_disk_max_age_h is None else args.cache_disk_max_age_h
    if not max_age_h >= 0:
        raise SystemExit(f"hearth runner: --cache-disk-max-age-h must be 0 (never) or hours, not {max_age_h}")
    try:
        cache_ram_bytes(cache_ram)
        if cache_disk_mib < -1 or cache_disk_mib == 0:
            raise ValueError(f"--cache-disk-mib must be -1 (no limit) or a size in MiB, not {cache_disk_mib}")
    except ValueError as exc:
        raise SystemExit(f"hearth runner: {exc}")
    return cache_ram, cache_disk_mib, max_age_h


def _runner_config(args, template: str | None, placement: dict, grammar: str | None, spec,
                   tiers: tuple[int, int, float]):
    """The RunnerConfig of the checked flags; the API keys come from --api-key and the environment."""
    from app.netguard import HostPolicy
    from app.residency.supervisor import RUNNER_KEY_ENV
    from app.runner.config import RunnerConfig

    cache_ram, cache_disk_mib, max_age_h = tiers
    mode = Mode.SERIAL.value if args.cont_batching is False else args.mode
    # The environment's key, as llama-server reads LLAMA_API_KEY: a key on the command line is shown by `ps`.
    from_env = os.environ.pop(RUNNER_KEY_ENV, "")
    api_keys = tuple(k.strip() for v in [*args.api_key, from_env] for k in v.split(",") if k.strip())
    try:
        HostPolicy.parse(args.image_url_hosts)
    except ValueError as exc:
        raise SystemExit(f"hearth runner: --image-url-hosts: {exc}")
    return RunnerConfig(
        model=model_config(args, resolve_model(args.model), n_ubatch=args.ubatch, flash_attn=args.flash_attn,
                           type_k=args.cache_type_k, type_v=args.cache_type_v, **placement,
                           n_outputs_extra=spec.draft_max if spec.enabled else 0,
                           kv_transfer=bool(cache_ram or args.cache_disk) and args.prefix_cache),
        cache_ram_mib=cache_ram,
        cache_disk=args.cache_disk,
        cache_disk_mib=cache_disk_mib,
        cache_disk_max_age_s=max_age_h * 3600 or None,
        mode=mode,
        spec=spec,
        draft_model=draft_model_config(args, spec),
        token_budget=args.budget,
        max_waiting=args.max_waiting,
        alias=args.alias,
        prefix_cache=args.prefix_cache,
        default_max_tokens=None if args.n_predict == -1 else args.n_predict,
        default_temperature=args.temp,
        default_seed=None if args.seed is None or args.seed == -1 else args.seed,
        api_keys=api_keys,
        metrics=args.metrics,
        slots=args.slots,
        chat_template=template,
        embedding=args.embedding,
        pooling=args.pooling,
        reranking=args.reranking,
        cors_origins=args.cors_origins,
        verbose=args.runner_verbose,
        tags=tuple(t.strip() for t in args.tags.split(",") if t.strip()),
        reasoning=args.reasoning,
        reasoning_format=args.reasoning_format,
        reasoning_budget=args.reasoning_budget,
        reasoning_budget_message=args.reasoning_budget_message,
        grammar=grammar,
        mmproj=None if args.no_mmproj or not args.mmproj else _existing(args.mmproj, "--mmproj"),
        images=ImageLimits(max_bytes=args.image_max_bytes, max_pixels=args.image_max_pixels,
                           max_request_pixels=args.image_max_request_pixels,
                           fetch_urls=args.image_url_fetch, fetch_allowed_hosts=args.image_url_hosts,
                           fetch_timeout_s=args.image_url_timeout),
    )
