"""The `hearth` command."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from app.devtools import command as bench
from app.gateway import command as tokens
from app.policy import MODEL_POLICIES, RUNNER_KINDS, Mode
from app.runner.command import _add_runner, _runner, resolve_model


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = argparse.ArgumentParser(prog="hearth", description="The household's shared local LLM server.")
    parser.add_argument("-v", "--verbose", action="store_true", help="more logging")
    sub = parser.add_subparsers(dest="command", required=True)
    # The order here is the order `hearth --help` lists them in.
    for add in (_add_runner, bench.add_arguments, _add_serve, tokens.add_arguments, _add_traffic, _add_models, _add_soak,
                _add_classes, _add_backup, _add_settings, _add_doctor):
        add(sub)
    return parser


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    """`hearth doctor`: what this box offers (build, devices, GPU readings) and what Hearth will do."""
    doc = sub.add_parser("doctor", help="explain the box: llama.cpp build, devices, GPU memory, what Hearth will do")
    doc.add_argument("--json", action="store_true", help="the report as JSON")












































def _add_serve(sub: argparse._SubParsersAction) -> None:
    """`hearth serve`: the household server."""
    serve = sub.add_parser("serve", help="the household server: gateway, residency, store (gunicorn, one worker)")
    serve.add_argument("--bind", default=None, help="host:port (default $HEARTH_BIND or 127.0.0.1:8080)")




def _add_traffic(sub: argparse._SubParsersAction) -> None:
    """`hearth traffic`: the request log's overlap."""
    traffic = sub.add_parser("traffic", help="how often requests overlap (request log) and residency advice")
    traffic.add_argument("--days", type=float, default=7.0, help="window (default %(default)s days)")


def _add_models(sub: argparse._SubParsersAction) -> None:
    """`hearth models ...`: model files, their settings and nodes."""
    models = sub.add_parser("models", help="model files")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    models_sub.add_parser("default", help="assemble the embedded default model (once) and print its path")
    models_sub.add_parser("list", help="scan the models folder now: usable models, estimates, unusable files and why")
    mrand = models_sub.add_parser("random", help="write a random-weight GGUF of a real model's shape (for benchmarks)")
    mrand.add_argument("shape", help="llama-3.2-1b, llama-3.1-8b, qwen3-30b-a3b, gpt-oss-20b (MoE), tiny, qwen3moe-tiny "
                       "or gpt-oss-tiny (app/devtools/gguf_shapes.py: SHAPES); "
                       "mmproj-gemma3-tiny or mmproj-gemma3-siglip: a projector (app/devtools/mmproj.py); "
                       "mmproj-qwen2a-tiny, mmproj-ultravox-tiny or mmproj-qwen2a-base: an audio projector "
                       "(app/devtools/audio_mmproj.py)")
    mrand.add_argument("out", help="the GGUF file to write")
    mrand.add_argument("--type", choices=["q8_0", "f16"], default="q8_0", help="weight type (default %(default)s)")
    mrand.add_argument("--seed", type=int, default=0)
    mrand.add_argument("--text-model", help="for an mmproj shape: the text model whose width the projector's "
                       "output takes (default: the embedded model)")
    mpull = models_sub.add_parser("pull", help="download a GGUF into the models folder (resumable, checked before the weights)")
    mpull.add_argument("source", help="hf.co/owner/repo:Q4_K_M, owner/repo/file.gguf, or an http(s) URL (#sha256=... to check)")
    mset = models_sub.add_parser("set", help="residency policy and runner settings of one model")
    mset.add_argument("name")
    mset.add_argument("--policy", choices=MODEL_POLICIES)
    mset.add_argument("--keep-alive-s", type=int)
    mset.add_argument("--alias", help="another name clients may use ('' removes it)")
    mset.add_argument("--runner", choices=RUNNER_KINDS, help="which runner serves it locally")
    mset.add_argument("--binary", help="llama-server binary for --runner llama-server")
    for flag in ("ctx", "parallel", "batch", "threads", "gpu-layers"):
        mset.add_argument(f"--{flag}", type=int)
    mset.add_argument("--mode", choices=[m.value for m in Mode])
    mset.add_argument("--draft-model", help="the model that drafts for this one while speculation is auto (a smaller "
                                            "model of the same vocabulary; 'none' removes it)")
    mset.add_argument("--kv-type", help="KV cache type, K and V alike: f16 (default), q8_0, q4_0, ... (-ctk/-ctv)")
    mset.add_argument("--n-cpu-moe", type=int, help="experts of the first N layers kept in RAM (-1: every layer's, "
                                                     "--cpu-moe; 0: none)")
    mset.add_argument("--devices", help="GPUs its layers may use, e.g. Vulkan0,Vulkan1 ('' : all)")
    mset.add_argument("--tensor-split", help="the layers' shares per GPU, e.g. 3,1 ('': by free memory)")
    mset.add_argument("--split-mode", choices=("none", "layer", "row"))
    mset.add_argument("--main-gpu", type=int, help="the GPU of the whole model with --split-mode none")
    mtrunc = models_sub.add_parser("truncate", help="write a copy of a GGUF with only its first N blocks: a smaller "
                                                    "model of the same vocabulary, a stand-in draft model")
    mtrunc.add_argument("source", help="the GGUF to copy")
    mtrunc.add_argument("out", help="the GGUF file to write")
    mtrunc.add_argument("--layers", type=int, default=6, help="blocks to keep (default %(default)s)")
    node = models_sub.add_parser("node", help="add or remove a remote node (OpenAI-compatible server) for a model")
    node.add_argument("action", choices=["add", "remove"])
    node.add_argument("name")
    node.add_argument("url")
    node.add_argument("--label")


def _add_soak(sub: argparse._SubParsersAction) -> None:
    """`hearth soak`: the load test."""
    soak = sub.add_parser("soak", help="load test: mixed classes, clients hanging up mid-stream; PASS/FAIL per criterion")
    soak.add_argument("--streams", type=int, default=32, help="concurrent clients (default %(default)s)")
    soak.add_argument("--minutes", type=float, default=2.0, help="duration (default %(default)s)")
    soak.add_argument("--disconnect", type=float, default=0.2, help="share of requests hung up mid-stream")
    soak.add_argument("--url", help="an existing hearth serve (default: start one on the default model)")
    soak.add_argument("--token", help="API token for --url, allowed the classes to soak")
    soak.add_argument("--model", help="GGUF for the started serve (default: the embedded model)")
    soak.add_argument("--ctx", type=int, default=4096, help="KV cells of the started serve's runner")
    soak.add_argument("--parallel", type=int, default=8, help="sequence slots of the started serve's runner")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--json", action="store_true", help="print the report as JSON")


def _add_classes(sub: argparse._SubParsersAction) -> None:
    """`hearth classes ...`: request classes."""
    classes = sub.add_parser("classes", help="request classes")
    classes_sub = classes.add_subparsers(dest="classes_command", required=True)
    classes_sub.add_parser("list", help="the classes and their policies")
    cset = classes_sub.add_parser("set", help="edit a class: FIELD=VALUE ...")
    cset.add_argument("name")
    cset.add_argument("assignments", nargs="+", metavar="FIELD=VALUE")


def _add_backup(sub: argparse._SubParsersAction) -> None:
    """`hearth backup` and `hearth restore`."""
    bk = sub.add_parser("backup", help="consistent copy of the store, safe while hearth serve runs")
    bk.add_argument("file")
    rs = sub.add_parser("restore", help="replace the store with a backup (stop hearth serve first)")
    rs.add_argument("file")
    rs.add_argument("--revive-tokens", action="store_true",
                    help="let tokens revoked or deleted since the backup work again (default: they stay revoked)")


def _add_settings(sub: argparse._SubParsersAction) -> None:
    """`hearth settings ...`: stored settings."""
    settings = sub.add_parser("settings", help="stored settings")
    settings_sub = settings.add_subparsers(dest="settings_command", required=True)
    settings_sub.add_parser("list", help="every setting, its value, what it does and its bounds")
    sset = settings_sub.add_parser("set", help="set a setting, checked against its kind and bounds ('null' restores the default)")
    sset.add_argument("name")
    sset.add_argument("value")



def main(argv: list[str] | None = None) -> int:
    """Entry point of the `hearth` console command."""
    args = build_parser().parse_args(argv)
    if argv is None and args.command in ("token", "models", "classes", "settings", "backup", "restore", "traffic"):
        # `hearth models list | head` should end quietly. Only for these printing commands, and only
        # from the console (argv None): in a server, or in a test process that calls main(), SIGPIPE's
        # default action would kill the whole process the next time a socket peer hangs up.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    run = _COMMANDS.get(args.command)
    return run(args) if run is not None else 2


def _doctor(args) -> int:
    import json

    from app.services.doctor import examine, render

    report = examine()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def _soak(args) -> int:
    from app.devtools.serving.soak import main as soak_main

    return soak_main(args)


def _models(args) -> int:
    """`hearth models ...`: the files Hearth makes itself here (random, truncate, default), the rest in app.admin."""
    if args.models_command == "random" and args.shape.startswith("mmproj"):
        from app.devtools import audio_mmproj, mmproj

        if args.shape in audio_mmproj.AUDIO_SHAPES:
            return audio_mmproj.run_from_args(args, resolve_model(args.text_model))
        if args.shape not in mmproj.MMPROJ_SHAPES:
            shapes = ", ".join([*mmproj.MMPROJ_SHAPES, *audio_mmproj.AUDIO_SHAPES])
            raise SystemExit(f"hearth: unknown projector shape {args.shape!r}; choose from {shapes}")
        return mmproj.run_from_args(args, resolve_model(args.text_model))
    if args.models_command == "random":
        from app.devtools.gguf_shapes import run_from_args as run_random_model

        return run_random_model(args)
    if args.models_command == "truncate":
        from app.devtools.draft_gguf import run_from_args as run_truncate

        try:
            return run_truncate(args, resolve_model(args.source))
        except ValueError as exc:
            print(f"hearth models truncate: {exc}", file=sys.stderr)
            return 2
    if args.models_command == "default":
        print(resolve_model(None))
        return 0
    return _admin(args)


def _serve(args) -> int:
    from app.serve import serve as run_serve

    run_serve(args.bind)
    return 0


def _admin(args) -> int:
    from app.admin import run as run_admin

    return run_admin(args)
    if args.command == "models" and args.models_command == "default":
        print(resolve_model(None))
        return 0
    if args.command == "serve":
        from app.serve import serve as run_serve

        run_serve(args.bind)
        return 0
    if args.command == "token":
        return tokens.run(args)
    if args.command in ("backup", "restore"):
        return _backup(args)
    if args.command in ("models", "classes", "settings"):
        from app.admin import run as run_admin

        return run_admin(args)
    return 2






















def _traffic(args) -> int:
    from app.paths import data_dir
    from app.store.db import open_store
    from app.store.settings import get_setting
    from app.verdict.overlap import format_traffic, traffic

    db_engine, sessions = open_store(data_dir())
    try:
        with sessions() as session:
            t = traffic(session, args.days, burst_overlap=int(get_setting(session, "verdict_burst_overlap")))
            print(format_traffic(t, float(get_setting(session, "verdict_rare_overlap_share"))))
    finally:
        db_engine.dispose()
    return 0


def _backup(args) -> int:
    from app.paths import data_dir
    from app.store.backup import BackupError, backup, restore

    try:
        if args.command == "backup":
            size = backup(data_dir(), Path(args.file))
            print(f"backed up the store to {args.file} ({size / 1024 / 1024:.1f} MiB, integrity ok)")
        else:
            report = restore(data_dir(), Path(args.file), revive_tokens=args.revive_tokens)
            print("\n".join(report.lines()))
    except BackupError as exc:
        print(f"hearth {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0


# `hearth NAME` -> its handler; each imports what it runs only when called, so `hearth --help` stays fast.
_COMMANDS = {"runner": _runner, "doctor": _doctor, "soak": _soak, "bench": bench.run, "traffic": _traffic,
             "models": _models, "serve": _serve, "token": tokens.run, "backup": _backup, "restore": _backup,
             "classes": _admin, "settings": _admin}


if __name__ == "__main__":
    sys.exit(main())
