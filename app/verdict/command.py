"""`hearth bench replay` on the command line: run a session, print the constants, tables, overlap and verdict."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

from tqdm import tqdm

from app.llama_tools import BUILD_SCRIPT, stock_llama_server, tools_cache_dir
from app.paths import data_dir
from app.policy import MODES
from app.residency.supervisor import RunnerStartFailed
from app.store.db import open_store
from app.verdict import sessions as store
from app.verdict.decide import format_verdict
from app.verdict.overlap import format_overlap
from app.verdict.replay import BenchConfig, run_bench, total_runs
from app.verdict.results import RunResult
from app.verdict.scenarios import Scenario, ScenarioError, load_scenario
from app.verdict.spec import DEFAULT_LLAMA_SPEC, SpecAxisError, parse_arms
from app.verdict.tables import comparison, figure, format_comparison, format_plan, format_spec, format_table, spec_rows
from app.verdict.targets import Constants, Target


def axes(args, scenario: Scenario) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The modes, speculation arms and llama-server arms to run: as given, else the scenario's [bench] defaults.

    --spec none (or a scenario without a spec default) is no axis; a spec axis without --llama-spec gives
    llama-server each of its n-gram types. SpecAxisError names a bad arm."""
    if getattr(args, "modes", None) is None:
        modes = scenario.modes or MODES
    else:
        modes = tuple(args.modes) if args.modes != ["none"] else ()
    text = getattr(args, "spec", None)
    spec = scenario.spec if text is None else (() if text.strip() == "none" else parse_arms(text))
    llama_text = getattr(args, "llama_spec", None)
    if llama_text is not None:
        llama = parse_arms(llama_text, llama=True)
    else:
        llama = (scenario.llama_spec or DEFAULT_LLAMA_SPEC) if spec else ()
    return tuple(modes), tuple(spec), tuple(llama)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run_from_args(args, model_path: str, start_serve: Callable[[Constants, str | None], Target] | None = None) -> int:
    """`hearth bench replay`: run, print the constants, table, overlap and verdict; write JSON/CSV if asked."""
    try:
        scenario = load_scenario(args.scenario)
        modes, spec, llama_spec = axes(args, scenario)
    except (ScenarioError, SpecAxisError) as exc:
        print(f"hearth bench replay: {exc}", file=sys.stderr)
        return 2
    llama = None
    if args.llama_server:
        llama = args.llama_server if args.llama_server != "auto" else str(_stock_llama_server())
    cfg = BenchConfig(scenario=args.scenario, levels=tuple(args.levels), modes=modes,
                      model_path=model_path, n_ctx=args.ctx, parallel=args.parallel,
                      n_batch=args.batch, token_budget=args.budget, threads=args.threads,
                      gpu_layers=args.gpu_layers, target_url=args.target, llama_server=llama, serve=args.serve,
                      traffic_days=args.days, repeats=args.repeats,
                      slots=tuple(args.slots) if getattr(args, "slots", None) else None,
                      spec=spec, llama_spec=llama_spec if llama else ())
    db_engine, sessions = open_store(data_dir())
    bar = tqdm(total=total_runs(cfg, scenario), desc="bench replay", unit="run", file=sys.stderr)

    def progress(run: RunResult, done: int, total: int) -> None:
        bar.total = total
        bar.set_postfix_str(f"{run.target} L={run.level} S={run.slots}: {figure(run.summary['gen_tok_s'])} tok/s")
        bar.update(1)

    # SIGTERM (a `kill`, a service manager, a timeout) unwinds like Ctrl-C instead of ending the process where
    # it stands: run_bench's finally then stops the hearth serve and the runners it started, which would
    # otherwise be left running, orphaned.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        outcome = run_bench(cfg, sessions, progress=progress, log=lambda line: bar.write(line, file=sys.stderr),
                            start_serve=start_serve)
    except (ValueError, RuntimeError, RunnerStartFailed) as exc:
        # RuntimeError: a target that did not answer (serve's warm-up, requests that never finished).
        print(f"hearth bench replay: {exc}", file=sys.stderr)
        db_engine.dispose()
        return 2
    finally:
        bar.close()
    print("hearth bench replay — held constant:")
    for k, v in outcome.constants.items():
        if k not in ("classes", "runner_plan"):
            print(f"  {k}: {v}")
    print("runners started (slots per level):")
    print("\n".join(format_plan(outcome.constants["runner_plan"])))
    print()
    print(format_table(outcome.runs))
    spec_table = spec_rows(outcome.runs)
    if spec_table:
        print("\nspeculative decoding, each arm (same run, same client, same prompts; greedy):")
        print(format_spec(spec_table))
    compared = comparison(outcome.runs)
    if compared:
        print("\nhearth over the reference server, same run, same client, same prompts:")
        print(format_comparison(compared))
    print()
    print(f"household overlap ({outcome.verdict.overlap.source}):")
    print(format_overlap(outcome.traffic))
    print()
    print(format_verdict(outcome.verdict))
    print(f"\nstored as bench session {outcome.session_id} (raw per-request rows kept)")
    doc = store.document(scenario.name, outcome.constants, outcome.verdict.as_dict(), outcome.runs,
                         outcome.session_id)
    doc["comparison"] = compared
    doc["speculation"] = spec_table
    doc["traffic"] = outcome.traffic
    if args.json_path:
        store.write_json(doc, args.json_path)
        print(f"wrote {args.json_path}", file=sys.stderr)
    if args.csv_path:
        raw = store.write_csv(outcome.runs, args.csv_path)
        print(f"wrote {args.csv_path} and {raw}", file=sys.stderr)
    db_engine.dispose()
    return 0


def _stock_llama_server():
    """The llama-server built by scripts/build_llama_tools.sh for the pinned version."""
    path = stock_llama_server()
    if path is None:
        raise SystemExit(f"hearth bench replay: llama-server is not built (looked in {tools_cache_dir() / 'bin'}); "
                         f"run {BUILD_SCRIPT}")
    return path
