"""`hearth bench`'s command line: every bench's arguments, and the table that runs the one asked for."""

from __future__ import annotations

import argparse
import importlib
import os

from app.hardware import usable_cores
from app.policy import MODES, Mode
from app.runner.command import _add_model_args, model_config, resolve_model


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("levels must be positive integers")
    return levels


def _modes(text: str) -> list[str]:
    modes = [x.strip() for x in text.split(",") if x.strip()]
    valid = {m.value for m in Mode}
    bad = [m for m in modes if m not in valid]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {bad}; choose from {sorted(valid)}")
    return modes


def add_arguments(sub: argparse._SubParsersAction) -> None:
    """`hearth bench ...`: the benchmarks."""
    bench = sub.add_parser("bench", help="benchmarks that print figures and write JSON")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for add in (_add_bench_engine, _add_bench_overhead, _add_bench_vram, _add_bench_tools, _add_bench_memory,
                _add_bench_gateway, _add_bench_flood, _add_bench_residency, _add_bench_sampling, _add_bench_history,
                _add_bench_replay, _add_bench_pull, _add_bench_members, _add_bench_hostile, _add_bench_templates,
                _add_bench_parsing, _add_bench_families, _add_bench_spec, _add_bench_tiers,
                _add_bench_vision):
        add(bench_sub)
    from app.devtools.serving import ceiling_bench

    ceiling_bench.add_arguments(bench_sub.add_parser("ceiling", help="the serving path's token ceiling: runner and "
                                                     "serve against stock llama-server on a tiny random model"))
    from app.devtools.serving import container_bench

    container_bench.add_arguments(bench_sub.add_parser("container", help="the image's size, and decode speed in the "
                                                       "container against the bare-metal runner on the same box"))
    from app.devtools.parity import audio_bench

    audio_bench.add_arguments(bench_sub.add_parser("audio", help="audio: hearth runner against stock llama-server "
                                                   "(oracle) per format and route, whole and streamed"))
    from app.devtools.serving import speech_attack

    speech_attack.add_arguments(bench_sub.add_parser("speech-attack", help="issue 50's attacks on serve's speech "
                                                     "surfaces: crafted FLACs, short WAVs, Wyoming trickle, caps, RSS"))
    from app.devtools.serving import voice_bench

    voice_bench.add_tts_arguments(bench_sub.add_parser("tts", help="time to first audio of a one-sentence "
                                                       "/v1/audio/speech through serve, alone and under background "
                                                       "decoding, and what speech costs that decode"))
    voice_bench.add_loop_arguments(bench_sub.add_parser("voice-loop", help="a spoken request through serve: "
                                                        "transcript, LLM answer in the voice class, each sentence "
                                                        "spoken; the time of each stage"))


def _add_bench_vision(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench vision`: images against stock llama-server, and the pause an image causes a decoding stream."""
    vis = bench_sub.add_parser("vision", help="images: hearth runner --mmproj against stock llama-server (oracle), and "
                                              "the longest pause an image causes a decoding voice stream (lab figure)")
    vis.add_argument("--model", help="GGUF path (default: the embedded Gemma 3 270M)")
    vis.add_argument("--threads", type=int, default=usable_cores())
    vis.add_argument("--ctx", type=int, default=2048)
    vis.add_argument("--shape", default="mmproj-gemma3-base",
                     help="projector of the pause arms (app/devtools/mmproj.py; default %(default)s)")
    vis.add_argument("--images", type=int, default=None,
                     help="oracle images per format (default 3; 2 with --serve)")
    vis.add_argument("--max-tokens", type=int, default=16, help="oracle tokens generated (default %(default)s)")
    vis.add_argument("--rounds", type=int, default=5, help="pause rounds, arms interleaved (default %(default)s)")
    vis.add_argument("--warm-tokens", type=int, default=16, help="stream tokens before the second request")
    vis.add_argument("--stream-tokens", type=int, default=160, help="tokens the voice stream generates")
    vis.add_argument("--skip-oracle", action="store_true", help="no oracle against stock llama-server")
    vis.add_argument("--serve", action="store_true",
                     help="only the serve oracle: one hearth serve (default settings) and its five image routes "
                          "(OpenAI, Ollama chat and generate, Anthropic, Responses) against stock llama-server")
    vis.add_argument("--keep", action="store_true", help="--serve: keep the data folder and the logs")
    vis.add_argument("--skip-memory", action="store_true", help="no RSS of runners without and with the projector")
    vis.add_argument("--skip-pause", action="store_true", help="no pause arms (and no memory part)")
    vis.add_argument("--memory-only", action="store_true",
                     help="only the projectors' memory: measured RSS against the estimate, per projector")
    vis.add_argument("--memory-projectors", default=None,
                     help="comma-separated mmproj files for --memory-only (default: the tiny and base random shapes)")
    vis.add_argument("--llama-server", help="stock llama-server binary (default: the built one, if any)")
    vis.add_argument("--json", dest="json_path", help="write every figure and raw gap here")


def _add_bench_spec(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench spec`: one stream copying a function list, speculation off and on, beside llama-server's types."""
    kvb = bench_sub.add_parser("kv-types", help="KV cache types (-ctk/-ctv): KV bytes (estimate, llama.cpp's buffers) "
                                                "and the mean KL divergence of the next token against f16")
    kvb.add_argument("--model", help="GGUF path (default: the embedded Gemma 3 270M)")
    kvb.add_argument("--threads", type=int, default=usable_cores())
    kvb.add_argument("--ctx", type=int, default=4096, help="KV cells (default %(default)s)")
    kvb.add_argument("--types", default="f16,q8_0,q4_0", help="types to compare with f16, K and V alike")
    kvb.add_argument("--tokens", type=int, default=160, help="positions of the fixed text compared (default %(default)s)")
    kvb.add_argument("--llama-server", help="stock llama-server: also compare greedy tokens with the same flags")
    kvb.add_argument("--max-tokens", type=int, default=32, help="greedy tokens compared with llama-server")
    kvb.add_argument("--json", dest="json_path", help="write every figure here")
    plc = bench_sub.add_parser("placement", help="a random MoE under llama-server -ngl/--n-cpu-moe: the estimate per "
                                                 "device against llama.cpp's buffer lines")
    plc.add_argument("--llama-server", required=True, help="stock llama-server (a Vulkan build with --vulkan)")
    plc.add_argument("--model", help="GGUF (default: a bench-sized random qwen3moe written to --out-dir)")
    plc.add_argument("--out-dir", default=".", help="where the random model is written (default: here)")
    plc.add_argument("--vulkan", action="store_true", help="offload to Vulkan0 (Mesa's lavapipe, 2 GiB)")
    plc.add_argument("--ngl", type=int, default=99, help="-ngl (default %(default)s)")
    plc.add_argument("--n-cpu-moe", type=int, default=4, help="--n-cpu-moe (default %(default)s)")
    plc.add_argument("--ctx", type=int, default=1024)
    fit = bench_sub.add_parser("fit", help="Hearth's fit against llama-server's --fit on a Vulkan device (lavapipe)")
    fit.add_argument("--llama-server", required=True, help="a Vulkan build of llama-server")
    fit.add_argument("--model", required=True, help="GGUF (e.g. hearth models random llama-3.2-1b FILE)")
    fit.add_argument("--targets", default="1024,1536,768", help="--fit-target values in MiB (default %(default)s)")
    fit.add_argument("--device-mib", type=int, default=2048, help="the device's memory (lavapipe: 2048)")
    fit.add_argument("--kv-auto", action="store_true", help="let Hearth choose q8_0 KV where f16 does not fit")
    spc = bench_sub.add_parser("spec", help="one repetitive stream: speculative decoding off/on, hearth runner and "
                                            "stock llama-server (lab figure)")
    spc.add_argument("--model", help="GGUF path (default: the embedded Gemma 3 270M)")
    spc.add_argument("--threads", type=int, default=usable_cores())
    spc.add_argument("--ctx", type=int, default=4096)
    spc.add_argument("--parallel", type=int, default=1, help="slots of every runner (default %(default)s)")
    spc.add_argument("--max-tokens", type=int, default=256)
    spc.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every arm (default %(default)s)")
    spc.add_argument("--best-of", type=int, default=2, help="requests per server start, the best rate taken "
                                                            "(default %(default)s)")
    spc.add_argument("--prompts", default="code,prose,free",
                     help="code (copying with a rename), prose (a story, greedy: the model loops on it), free (the "
                          "story sampled: drafts mostly fail), functions (copied unchanged) (default %(default)s)")
    spc.add_argument("--llama-server", help="stock llama-server binary to compare with (scripts/build_llama_tools.sh)")
    spc.add_argument("--hearth-types", default="none,ngram-lookup,ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,"
                                               "draft-simple", help="hearth runner --spec-type arms (draft-simple: "
                                                                    "with --draft-model only)")
    spc.add_argument("--llama-types", default="none,ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,draft-simple",
                     help="llama-server --spec-type arms")
    spc.add_argument("--hearth-args", default="", help="more hearth runner arguments, e.g. '--no-repack'")
    spc.add_argument("--draft-model", help="draft model (-md) of the draft-simple arms of either kind, e.g. "
                                           "`hearth models truncate`'s copy of the model")
    spc.add_argument("--json", dest="json_path", help="write every arm's figures and texts here")


def _add_bench_tiers(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench tiers`: a ~2,000-token system prompt's next turn from the KV cache, the RAM tier, the disk tier."""
    t = bench_sub.add_parser("tiers", help="voice satellite's next turn: full prefill vs KV hit vs RAM tier (evicted) "
                                           "vs disk tier (runner restarted) (lab figure)")
    t.add_argument("--model", help="GGUF path (default: the embedded Gemma 3 270M)")
    t.add_argument("--threads", type=int, default=usable_cores())
    t.add_argument("--ctx", type=int, default=4096,
                   help="cells: the system prompt and the evicting prompt must not fit together (default %(default)s)")
    t.add_argument("--parallel", type=int, default=2)
    t.add_argument("--reps", type=int, default=3, help="repetitions, each on a fresh disk folder (default %(default)s)")
    t.add_argument("--llama-server", help="stock llama-server binary: its next turn after a restart, for comparison")
    t.add_argument("--json", dest="json_path", help="write every repetition's raw figures here")
    t.add_argument("--cost", action="store_true",
                   help="instead: generated tok/s of --parallel concurrent streams with the tiers off and on")
    t.add_argument("--cost-tokens", type=int, default=128, help="--cost: tokens per stream (default %(default)s)")
    t.add_argument("--serve", action="store_true",
                   help="instead: through hearth serve with default settings and a one-model memory budget: the "
                        "voice turn after a swap and after a restart, an ~8,000-token conversation after a swap "
                        "(with --cost: the household mix with the tiers off and on)")
    t.add_argument("--level", dest="parallel_level", type=int, default=8,
                   help="--serve --cost: household requests at once (default %(default)s)")
    t.add_argument("--turns", type=int, default=24,
                   help="--serve: user/assistant pairs of the long conversation, ~400 tokens each (default %(default)s)")
    t.add_argument("--reload", action="store_true",
                   help="instead: the model's reload time with its weights warm in the page cache vs cold "
                        "(DONTNEED before the load), median of --reps each")


def _add_bench_engine(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench engine`: the engine in-process, modes × overlap levels."""
    eng = bench_sub.add_parser("engine", help="drive the engine in-process: modes × overlap levels")
    _add_model_args(eng, ctx=4096, parallel=8)
    eng.add_argument("--levels", type=_levels, default=[1, 2, 4, 8])
    eng.add_argument("--modes", type=_modes, default=list(MODES))
    eng.add_argument("--reference", help="path to llama.cpp's llama-batched-bench (see scripts/build_llama_tools.sh)")
    eng.add_argument("--json", dest="json_path", help="write every figure and the constants to this file")
    eng.add_argument("--stagger-ms", type=float, default=0.0,
                     help="gap between arrivals in the mixed workload (default %(default)s ms)")
    eng.add_argument("--repeats", type=int, default=1, help="repetitions per cell; medians are reported")
    eng.add_argument("--shared-prefix", type=int, default=0,
                     help="also run the shared-prefix workload with a prefix of this many tokens, cache on/off")
    eng.add_argument("--pressure-ctx", type=int, default=1024,
                     help="KV cells for the preemption scenario (8 long requests); 0 to skip")


def _add_bench_overhead(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench overhead`: Python work per iteration and sampling cost."""
    ovh = bench_sub.add_parser("overhead", help="the engine's Python work per iteration, decode taken out; sampling cost")
    ovh.add_argument("--levels", type=_levels, default=[1, 8, 32, 64], help="sequences decoding together")
    ovh.add_argument("--gen-tokens", type=int, default=400, help="tokens generated per request (default %(default)s)")
    ovh.add_argument("--repeats", type=int, default=3, help="repetitions per level; medians are reported")
    ovh.add_argument("--model", help="GGUF whose logits the sampling costs are taken on (default: the embedded model)")
    ovh.add_argument("--no-model", action="store_true", help="skip the real-model sampling costs")
    ovh.add_argument("--threads", type=int, default=usable_cores(), help="CPU threads for the real model")
    ovh.add_argument("--json", dest="json_path", help="write every figure and the constants to this file")


def _add_bench_vram(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench vram`: the residency estimate against NVML."""
    vk = bench_sub.add_parser("vulkan", help="the offload path on a Vulkan device (lavapipe in CI): layers, device "
                                             "buffers vs the estimate, freed after unload, greedy tokens vs stock "
                                             "llama-server's Vulkan build")
    vk.add_argument("--model", help="a GGUF (default: the tiny random-weight model, written to a temp folder)")
    vk.add_argument("--ctx", type=int, default=512)
    vk.add_argument("--parallel", type=int, default=1)
    vk.add_argument("--n-predict", type=int, default=16, help="greedy tokens per prompt (default %(default)s)")
    vk.add_argument("--json", dest="json_path", help="write the figures as JSON here")
    vram = bench_sub.add_parser("vram", help="the residency estimate against NVML's measured use; the NVML sampler under load")
    _add_model_args(vram, ctx=4096, parallel=8)
    vram.add_argument("--requests", type=int, default=8, help="completions sent at once while sampling (default %(default)s)")
    vram.add_argument("--json", dest="json_path", help="write every figure and the samples to this file")


def _add_bench_tools(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench tools`: constrained decoding."""
    tls = bench_sub.add_parser("tools", help="constrained decoding: throughput cost, grammar compile, call/JSON validity")
    tls.add_argument("--model", help="GGUF path (default: the embedded Gemma 3 270M)")
    tls.add_argument("--threads", type=int, default=2)
    tls.add_argument("--requests", type=int, default=50, help="HA-shaped requests and json_schema answers to check")
    tls.add_argument("--reps", type=int, default=3, help="interleaved throughput repetitions")
    tls.add_argument("--out", help="write the figures and raw per-request data here (JSON)")
    tls.add_argument("--parts", default="compile,throughput,validity", help="comma-separated parts to run")


def _add_bench_parsing(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench parsing`: what splitting answers costs a streamed answer's per-token time."""
    prs = bench_sub.add_parser("parsing", help="per-token time of 8 streams with the answer parser on and off")
    prs.add_argument("--model", help="GGUF path (default: the embedded Gemma 3 270M)")
    prs.add_argument("--threads", type=int, default=2)
    prs.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each arm (default %(default)s)")
    prs.add_argument("--max-tokens", type=int, default=128, help="tokens per stream (default %(default)s)")
    prs.add_argument("--out", help="write the figures and every stream's times here (JSON)")


def _add_bench_memory(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench memory`: a real runner's resident memory under load."""
    mem = bench_sub.add_parser("memory", help="resident memory of a real runner under concurrent load")
    _add_model_args(mem, ctx=4096, parallel=8)
    mem.add_argument("--requests", type=int, default=8, help="concurrent requests (default %(default)s)")
    mem.add_argument("--tokens", type=int, default=128, help="tokens generated per request (default %(default)s)")


def _add_bench_gateway(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench gateway`: what hearth serve adds over its runner."""
    gw = bench_sub.add_parser("gateway", help="added latency and streaming ratio of hearth serve vs its runner")
    _add_model_args(gw, ctx=4096, parallel=8)
    gw.add_argument("--samples", type=int, default=30, help="alternating latency samples (default %(default)s)")
    gw.add_argument("--streams", type=int, default=8, help="concurrent streams (default %(default)s)")
    gw.add_argument("--tokens", type=int, default=64, help="tokens per stream (default %(default)s)")
    gw.add_argument("--repeats", type=int, default=3, help="stream repetitions (default %(default)s)")
    gw.add_argument("--json", dest="json_path", help="write the raw samples here")


def _add_bench_flood(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench flood`: hearth serve under a flood of connections."""
    fl = bench_sub.add_parser("flood", help="hearth serve (default settings) under a flood of streams, half-open "
                                            "and idle connections: /healthz, voice TTFT, RSS, 5xx, leftovers")
    fl.add_argument("--model", help="GGUF file (default: the embedded Gemma 3 270M Q4_K_M)")
    fl.add_argument("--background", type=int, default=500, help="streamed background requests (default %(default)s)")
    fl.add_argument("--bg-tokens", type=int, default=8, help="tokens per background answer (default %(default)s)")
    fl.add_argument("--half-open", type=int, default=64, help="half-open connections (default %(default)s)")
    fl.add_argument("--idle", type=int, default=200, help="idle keep-alive connections (default %(default)s)")
    fl.add_argument("--voice", type=int, default=5, help="voice requests during the flood (default %(default)s)")
    fl.add_argument("--duration", type=float, default=30, help="seconds a held connection waits at most (default %(default)s)")
    fl.add_argument("--probe-ms", type=float, default=50, help="/healthz probe interval (default %(default)s)")
    fl.add_argument("--samples", type=int, default=30, help="alternating latency samples (default %(default)s)")
    fl.add_argument("--streams", type=int, default=8, help="concurrent streams, gateway vs direct (default %(default)s)")
    fl.add_argument("--tokens", type=int, default=64, help="tokens per stream (default %(default)s)")
    fl.add_argument("--repeats", type=int, default=3, help="stream repetitions (default %(default)s)")
    fl.add_argument("--long-prompt", type=int, default=3600, help="approximate prompt tokens of the TTFT check "
                                                                  "(default %(default)s)")
    fl.add_argument("--settle", type=float, default=60, help="seconds to wait for the baseline (default %(default)s)")
    fl.add_argument("--json", dest="json_path", help="write the raw figures here")


def _add_bench_residency(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench residency`: load/unload cycles."""
    res = bench_sub.add_parser("residency", help="load/unload cycles through hearth serve")
    _add_model_args(res, ctx=1024, parallel=2)
    res.add_argument("--cycles", type=int, default=20, help="load/unload cycles (default %(default)s)")


def _add_bench_sampling(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench sampling`: the telemetry job's CPU cost."""
    smp = bench_sub.add_parser("sampling", help="CPU cost of the 1-second telemetry job against a real runner")
    _add_model_args(smp, ctx=1024, parallel=2)
    smp.add_argument("--calls", type=int, default=100, help="sampler calls (default %(default)s)")


def _add_bench_history(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench history`: dashboard pages over synthetic history."""
    hist = bench_sub.add_parser("history", help="dashboard pages and store size with days of synthetic history")
    hist.add_argument("--days", type=float, default=7, help="days of 1-second samples in the timed store (default %(default)s)")
    hist.add_argument("--size-days", type=float, default=30, help="days of history in the size store (default %(default)s)")
    hist.add_argument("--runners", type=int, default=2, help="runners with samples (default %(default)s)")
    hist.add_argument("--gpus", type=int, default=1, help="GPUs with samples (default %(default)s)")
    hist.add_argument("--requests", type=int, default=100_000, help="request rows (default %(default)s)")
    hist.add_argument("--busy", type=float, default=0.15, help="share of time the runners are busy (default %(default)s)")
    hist.add_argument("--retention-h", type=float, default=48.0,
                      help="hours of 1-second samples kept in the 30-day size store (default %(default)s, the setting's default)")
    hist.add_argument("--seed", type=int, default=1)
    hist.add_argument("--repeat", type=int, default=20, help="timed GETs per page (default %(default)s)")
    hist.add_argument("--skip-size", action="store_true", help="do not build the 30-day size store")
    hist.add_argument("--quiet", action="store_true", help="no progress bars")
    hist.add_argument("--data", help="build the stores in this (empty) folder and keep them (default: a temporary folder)")
    hist.add_argument("--json", dest="json_path", help="write every figure and the constants to this file")


def _add_bench_pull(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench pull`: /healthz through serve while a partial file is resumed; or pull speed against curl."""
    pl = bench_sub.add_parser("pull", help="/healthz p99 through hearth serve while a large partial file is resumed and "
                                           "/api/show is called 50×/s (--speed: pull MB/s against curl's)")
    pl.add_argument("--model", help="GGUF /api/show is asked about, serve's default model (default: the embedded model)")
    pl.add_argument("--partial-gb", type=float, default=2.0, help="size of the partial file resumed (default %(default)s GiB)")
    pl.add_argument("--rest-mb", type=float, default=256, help="what the hub serves after it (default %(default)s MiB)")
    pl.add_argument("--show-rate", type=float, default=50, help="/api/show calls per second (default %(default)s)")
    pl.add_argument("--quiet-s", type=float, default=3, help="seconds of /healthz probes before the pull (default %(default)s)")
    pl.add_argument("--speed", action="store_true", help="measure pull MB/s against curl's instead")
    pl.add_argument("--file", help="with --speed: the file pulled (default: the embedded model)")
    pl.add_argument("--reps", type=int, default=5, help="with --speed: interleaved runs each (default %(default)s)")
    pl.add_argument("--json", dest="json_path", help="write the figures here")


def _add_bench_members(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench members`: another member's admission and TTFT while one member floods a class."""
    mb = bench_sub.add_parser("members", help="one member floods the chat class through hearth serve; another "
                                              "member's admission wait and TTFT against chat's target")
    mb.add_argument("--model", help="GGUF file (default: the embedded Gemma 3 270M Q4_K_M)")
    mb.add_argument("--flood", type=int, default=50, help="streamed requests the flooding member sends at once "
                                                          "(default %(default)s)")
    mb.add_argument("--flood-tokens", type=int, default=128, help="tokens per flood answer (default %(default)s)")
    mb.add_argument("--probes", type=int, default=5, help="the other member's requests, one after another "
                                                          "(default %(default)s)")
    mb.add_argument("--probe-tokens", type=int, default=8, help="tokens per probe answer (default %(default)s)")
    mb.add_argument("--shares", type=lambda v: [float(x) for x in v.split(",")], default=[0.5, 1.0],
                    help="member_class_share per round (default 0.5,1.0: the default, then one member may take "
                         "the whole class)")
    mb.add_argument("--json", dest="json_path", help="write the figures here")


def _add_bench_families(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench families`: the families' scripted answers through hearth serve in every API, beside llama-server."""
    fa = bench_sub.add_parser("families", help="each model family's scripted answers (reasoning, content, calls) "
                                               "through hearth serve: family x API x whole/stream right or wrong, "
                                               "beside stock llama-server on OpenAI chat")
    fa.add_argument("--families", help="comma-separated families (default: all of app/devtools/family_models.py)")
    fa.add_argument("--apis", help="comma-separated of openai,ollama,anthropic,responses (default: all)")
    fa.add_argument("--no-llama-server", action="store_true", help="skip the stock llama-server column")
    fa.add_argument("--verbose", action="store_true", help="print what arrived for each wrong answer")
    fa.add_argument("--json", help="write every outcome here")


def _add_bench_hostile(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench hostile`: the worst accepted bodies of ≤ 64 KiB, their compile time and a runner's memory."""
    ho = bench_sub.add_parser("hostile", help="for each bound, the largest body of ≤ 64 KiB still accepted: "
                                              "conversion and llama.cpp compile time, a real runner's RSS growth")
    ho.add_argument("--model", help="GGUF file (default: the embedded Gemma 3 270M Q4_K_M)")
    ho.add_argument("--threads", type=int, default=2, help="the runner's CPU threads (default %(default)s)")
    ho.add_argument("--only", help="comma-separated words: run only the families whose name holds one")
    ho.add_argument("--json", dest="json_path", help="write the figures here")


def _add_bench_templates(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench templates`: llama.cpp's vendored chat templates rendered by stock llama-server and Hearth."""
    tp = bench_sub.add_parser("templates", help="render parity: llama.cpp's vendored templates x 5 histories through "
                                                "stock llama-server and hearth runner's /apply-template, byte for byte")
    tp.add_argument("--model", help="GGUF file (default: the embedded Gemma 3 270M Q4_K_M)")
    tp.add_argument("--llama-server", help="stock llama-server binary (default: scripts/build_llama_tools.sh's)")
    tp.add_argument("--only", help="comma-separated words: only the templates whose file name holds one")
    tp.add_argument("--json", dest="json_path", help="write the summary and every pair that differs here")
    tp.add_argument("--record", help="write llama-server's renders here as golden files (tests/data/templates)")
    tp.add_argument("--hearth-src", help="run the runner from this copy of Hearth (a folder holding `app`), "
                                         "e.g. an older commit's `git archive`")


def _add_bench_replay(bench_sub: argparse._SubParsersAction) -> None:
    """`hearth bench replay`: the household bench."""
    rep = bench_sub.add_parser("replay", help="replay a household scenario over HTTP: modes × overlap levels, verdict")
    _add_model_args(rep, ctx=8192, parallel=8)
    rep.add_argument("--scenario", default="household", help="shipped scenario name or a .toml file (default %(default)s)")
    rep.add_argument("--levels", type=_levels, default=[1, 2, 4, 8],
                     help="requests at once (default %(default)s); a level above --parallel gets a runner with that many slots")
    rep.add_argument("--slots", type=_levels, default=None,
                     help="sweep the runner's slots instead, e.g. 4,8,16: every level on every slot count")
    rep.add_argument("--modes", type=lambda t: ["none"] if t == "none" else _modes(t),
                     default=None, help="hearth runner modes, or 'none' (default: the scenario's, else all)")
    rep.add_argument("--spec", default=None,
                     help="speculation arms of the hearth runners (and serve), e.g. off,ngram-lookup: off, auto or an "
                          "n-gram type; 'none' for no axis (default: the scenario's, e.g. code-edit's off,ngram-lookup)")
    rep.add_argument("--llama-spec", default=None,
                     help="the stock llama-server's arms with a speculation axis "
                          "(default off,ngram-simple,ngram-map-k,ngram-mod)")
    rep.add_argument("--target", help="also measure this OpenAI-compatible server (base URL)")
    rep.add_argument("--llama-server", nargs="?", const="auto", default=None,
                     help="also start stock llama-server with the same settings (binary path; default: the built one)")
    rep.add_argument("--serve", action="store_true",
                     help="also measure through `hearth serve` with default settings (fresh data folder, this model)")
    rep.add_argument("--repeats", type=int, default=1,
                     help="repetitions per level, target order reversed each time (default %(default)s)")
    rep.add_argument("--days", type=float, default=7.0, help="request-log window for the typical overlap (default %(default)s)")
    rep.add_argument("--json", dest="json_path", help="write summaries, verdict, constants and raw rows here")
    rep.add_argument("--csv", dest="csv_path", help="write one row per mode × level here (raw rows beside it)")


# `hearth bench NAME` -> (module, function, whether it takes the resolved model path after args). Imported only when
# that bench runs, so `hearth --help` stays fast.
_BENCHES = {
    "vulkan": ("app.devtools.gpu.vulkan_check", "run_from_args", False),
    "vram": ("app.devtools.gpu.gpu_probe", "run_from_args", True),
    "vision": ("app.devtools.parity.vision_bench", "run_from_args", True),
    "placement": ("app.devtools.gpu.moe_bench", "run_from_args", False),
    "fit": ("app.devtools.gpu.fit_bench", "run_from_args", False),
    "kv-types": ("app.devtools.engine.kv_bench", "run_from_args", True),
    "spec": ("app.devtools.engine.spec_bench", "main", False),
    "memory": ("app.devtools.engine.memory_bench", "run_from_args", True),
    "sampling": ("app.devtools.engine.telemetry_bench", "run_sampling", True),
    "pull": ("app.devtools.serving.pull_bench", "run_pull_bench", True),
    "members": ("app.devtools.serving.members_bench", "run_members_bench", True),
    "templates": ("app.devtools.parity.template_parity", "run_templates_bench", True),
    "hostile": ("app.devtools.serving.hostile_bench", "run_hostile_bench", True),
    "families": ("app.devtools.serving.families_bench", "run_from_args", False),
    "flood": ("app.devtools.serving.flood", "run_flood", True),
    "gateway": ("app.devtools.serving.gateway_bench", "run_gateway", True),
    "residency": ("app.devtools.serving.gateway_bench", "run_residency", True),
    "ceiling": ("app.devtools.serving.ceiling_bench", "run", False),
    "container": ("app.devtools.serving.container_bench", "run", False),
    "audio": ("app.devtools.parity.audio_bench", "run", False),
    "speech-attack": ("app.devtools.serving.speech_attack", "run", True),
    "tts": ("app.devtools.serving.voice_bench", "run_tts", True),
    "voice-loop": ("app.devtools.serving.voice_bench", "run_voice_loop", True),
}


def _bench_engine(args) -> int:
    from app.devtools.engine.engine_bench import run_from_args

    return run_from_args(args, model_config(args, resolve_model(args.model)))


def _bench_overhead(args) -> int:
    from app.devtools.engine.overhead import run_from_args as run_overhead

    return run_overhead(args, None if args.no_model else resolve_model(args.model))


def _bench_tiers(args) -> int:
    if args.serve:
        from app.devtools.serving import tiers_serve_bench

        return tiers_serve_bench.run_from_args(args)
    from app.devtools.engine.tiers_bench import main as run_tiers_bench

    return run_tiers_bench(args)


def _bench_parsing(args) -> int:
    from app.devtools.engine.parsing_bench import run_parsing_bench

    run_parsing_bench(resolve_model(args.model), args.threads, args.rounds, args.max_tokens, args.out)
    return 0


def _bench_tools(args) -> int:
    from app.devtools.engine.tools_bench import run_tools_bench

    run_tools_bench(resolve_model(args.model), args.threads, args.requests, args.reps, args.out,
                    tuple(args.parts.split(",")))
    return 0


def _bench_replay(args) -> int:
    from app.devtools.serve_process import serve_target
    from app.verdict.command import run_from_args as run_replay

    return run_replay(args, resolve_model(args.model), start_serve=serve_target)


def _bench_history(args) -> int:
    from app.devtools.serving.history_bench import run_history

    # HEARTH_DEFAULT_MODEL: a GGUF already at hand (tests share one) instead of assembling one.
    return run_history(args, resolve_model(os.environ.get("HEARTH_DEFAULT_MODEL")))


# The benches whose call is not (args) or (args, model path).
_BENCH_STEPS = {"engine": _bench_engine, "overhead": _bench_overhead, "tiers": _bench_tiers,
                "parsing": _bench_parsing, "tools": _bench_tools, "replay": _bench_replay,
                "history": _bench_history}


def run(args) -> int:
    """`hearth bench ...`: the benchmark asked for, with its model resolved."""
    name = args.bench_command
    if name in _BENCH_STEPS:
        return _BENCH_STEPS[name](args)
    if name not in _BENCHES:
        return 2
    module, function, takes_model = _BENCHES[name]
    run = getattr(importlib.import_module(module), function)
    return run(args, resolve_model(args.model)) if takes_model else run(args)
