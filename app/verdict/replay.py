"""`hearth bench replay`: a scenario replayed over HTTP against runners in each mode (and any other server).

Targets are a hearth runner started per mode (continuous, serial, static) with model, quantisation,
context, slots, threads and hardware held constant, a stock llama-server started with the same
settings, or any OpenAI-compatible URL. With a speculation axis (`--spec off,ngram-lookup`,
app.verdict.spec) each hearth mode, each `hearth serve` and each llama-server arm (`--llama-spec`)
is a target of its own, so drafting on and off are measured interleaved, with the same prompts. One client measures all of them in the same run, level by
level with the targets interleaved, so drift on a shared machine hits every target alike.

The load client is app.verdict.load, the targets' processes app.verdict.targets, the tables
app.verdict.tables and the command line app.verdict.command; this module runs a session: plans the
runner groups, starts them, replays level by level, stores every run and judges.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from app.hardware import machine
from app.paths import sha256_of
from app.policy import MODES, ClassPolicy
from app.repack import repack_works
from app.verdict.load import run_level
from app.verdict.results import RunResult, median_runs
from app.verdict.runners import ONCE_MODES, RunnerGroup, RunnerPlan, plan_runners
from app.verdict.scenarios import PromptCutter, Scenario, plan, script_size
from app.verdict.spec import DEFAULT_LLAMA_SPEC, label
from app.verdict.targets import (
    Constants,
    Target,
    external_target,
    http_cutter,
    start_hearth,
    start_llama_server,
    stop_targets,
    warm_up,
)
from app.verdict.ties import mark_near_ties


def levels_of(scenario: Scenario, levels: list[int]) -> list[int]:
    """The overlap levels to run: as asked for a mix; one run of all its requests for a script."""
    return list(levels) if scenario.kind == "mix" else [script_size(scenario)]


def replay(scenario: Scenario, targets: list[Target], levels: list[int], policies: dict[str, ClassPolicy],
           cutter: PromptCutter, progress: Callable[[RunResult], None] | None = None,
           repeats: int = 1, once_levels: tuple[int, ...] | None = None) -> list[RunResult]:
    """Every level on every target, targets interleaved within a level; same prompts for all targets.

    With repeats, each level runs again with the targets in reverse order (A B, B A, ...), so load
    that drifts during a level hits every target alike; ratios are taken within one repetition.
    Targets measured once per level (serial, an external server) skip levels not in once_levels.
    """
    results = []
    for level in levels_of(scenario, levels):
        planned = plan(scenario, level, cutter)
        here = [t for t in targets if once_levels is None or level in once_levels
                or (t.mode not in ONCE_MODES and t.kind != "external")]
        start = len(results)
        for rep in range(repeats):
            for target in (here if rep % 2 == 0 else list(reversed(here))):
                run = run_level(target, planned, policies, level)
                run.rep = rep
                results.append(run)
                if progress is not None:
                    progress(run)
        # A drafting arm's output that left its off arm's: how close a call it was there (app.verdict.ties).
        mark_near_ties(results[start:], here, planned)
    return results


@dataclass(frozen=True)
class BenchConfig:
    """What `hearth bench replay` (or the dashboard's Start) asked for."""

    scenario: str = "household"
    levels: tuple[int, ...] = (1, 2, 4, 8)
    modes: tuple[str, ...] = MODES
    model_path: str = ""
    n_ctx: int = 8192
    parallel: int = 8
    n_batch: int = 512
    token_budget: int | None = None
    threads: int = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    gpu_layers: int = 0
    target_url: str | None = None
    llama_server: str | None = None  # binary of a stock llama-server to start with the same settings
    serve: bool = False  # also measure through a `hearth serve` with default settings
    traffic_days: float = 7.0
    repeats: int = 1
    slots: tuple[int, ...] | None = None  # slot counts to sweep; None: enough slots for each level
    # Speculation arms (app.verdict.spec) of hearth runners and serve, and of the stock llama-server;
    # () is no axis (runners start without drafts, as their default; serve with its own default).
    spec: tuple[str, ...] = ()
    llama_spec: tuple[str, ...] = ()

    def arms(self) -> tuple[str | None, ...]:
        """The hearth runners' (and serve's) arms: (None,) without an axis."""
        return tuple(self.spec) or (None,)

    def llama_arms(self) -> tuple[str | None, ...]:
        """llama-server's arms: its own list; with a hearth axis but none of its own, each of its n-gram types."""
        return tuple(self.llama_spec) or ((None,) if not self.spec else DEFAULT_LLAMA_SPEC)


@dataclass
class BenchOutcome:
    """A finished session: its id, constants, runs and verdict."""

    session_id: int
    constants: dict
    runs: list[RunResult]
    verdict: object
    traffic: dict


def _batch_for(n_batch: int, slots: int) -> int:
    """n_batch for a runner with `slots` slots: a decode must hold one token of every slot."""
    return max(n_batch, slots)


def _memory_check(cfg: BenchConfig) -> tuple[Callable[[int, int], int] | None, int | None, str]:
    """One runner's estimated bytes by (n_ctx, slots), the headroom now, and what it was compared against."""
    from app.residency.budget import detect_budget
    from app.residency.catalog import scan
    from app.residency.estimate import estimate_memory

    entries = scan(None, Path(cfg.model_path))
    entry = entries[0] if entries else None
    if entry is None or not entry.usable:
        return None, None, f"not checked: {entry.unusable_reason if entry else 'no model file'}"
    budget = detect_budget(use_gpu=cfg.gpu_layers > 0)

    def runner_bytes(n_ctx: int, slots: int) -> int:
        return estimate_memory(entry, n_ctx, slots, _batch_for(cfg.n_batch, slots)).total_bytes

    return runner_bytes, budget.headroom_bytes(0), f"{budget.kind.upper()} free now, less the reserve"


def plan_for(cfg: BenchConfig, scenario: Scenario, check_memory: bool = True) -> RunnerPlan:
    """The runner groups the session starts: enough slots per level (or the sweep), checked against free memory."""
    levels = levels_of(scenario, list(cfg.levels))
    # A script's level is its number of requests, not an overlap: it keeps the configured slots.
    axis = cfg.slots or ((cfg.parallel,) if scenario.kind == "script" else None)
    runner_bytes, headroom, memory = None, None, "not checked"
    if check_memory and cfg.model_path and (cfg.modes or cfg.llama_server):
        runner_bytes, headroom, memory = _memory_check(cfg)
    serve_arms = len(cfg.arms()) if cfg.serve else 0
    return plan_runners(levels, cfg.modes, cfg.parallel, cfg.n_ctx, axis, bool(cfg.llama_server),
                        bool(cfg.target_url) + serve_arms, runner_bytes, headroom, memory,
                        spec=cfg.arms(), llama_spec=cfg.llama_arms())


def total_runs(cfg: BenchConfig, scenario: Scenario) -> int:
    """Runs the session will make (targets × levels × slot groups), for progress bars."""
    return plan_for(cfg, scenario).runs(cfg.repeats)


def describe_constants(cfg: BenchConfig, scenario: Scenario, model_name: str, class_policies: dict,
                       cutter_exact: bool, props: dict | None, runner_plan: RunnerPlan | None = None) -> dict:
    """Everything held constant, printed before the runs and kept with them."""
    model = (props or {}).get("model") or {}
    return {
        "scenario": scenario.name, "scenario_source": scenario.source, "scenario_kind": scenario.kind,
        "arrival": scenario.pattern if scenario.kind == "mix" else "script",
        "levels": levels_of(scenario, list(cfg.levels)), "modes": list(cfg.modes), "repeats": cfg.repeats,
        "model": cfg.model_path, "model_name": model_name,
        "model_sha256": sha256_of(cfg.model_path) if cfg.model_path else None,
        "model_desc": model.get("desc"), "n_ctx": cfg.n_ctx, "parallel": cfg.parallel, "n_batch": cfg.n_batch,
        "slots": list(cfg.slots) if cfg.slots else "enough for each level (at least parallel)",
        "kv_cells_per_slot": -(-cfg.n_ctx // cfg.parallel),
        "token_budget": cfg.token_budget or cfg.n_batch, "threads": cfg.threads, "gpu_layers": cfg.gpu_layers,
        "repack": repack_works(), "kv_unified": True,
        "sampling": "temperature 0, ignore_eos (fixed output lengths), cache_prompt off",
        "prompt_lengths": "exact (target's tokenizer)" if cutter_exact else "estimated (4 chars/token)",
        "llama_server": cfg.llama_server, "target_url": cfg.target_url, "serve": cfg.serve,
        "spec": list(cfg.spec) or "none (runners without drafts)",
        "llama_spec": list(cfg.llama_arms()) if cfg.llama_server and cfg.spec else None,
        "runner_plan": runner_plan.as_dict() if runner_plan else None,
        "classes": {n: asdict(p) for n, p in class_policies.items()},
        "machine": machine(),
    }


def run_bench(cfg: BenchConfig, sessions, progress: Callable[[RunResult, int, int], None] | None = None,
              log: Callable[[str], None] = lambda line: None,
              start_serve: Callable[[Constants, str | None], Target] | None = None) -> BenchOutcome:
    """Start each group of runners, replay, store every run as it ends, judge; stops what it started.

    With cfg.serve, start_serve(constants, arm) (app.devtools.serve_process.serve_target) starts a `hearth serve`
    target: arm None or "auto" with its default settings, another arm with that speculation (app.verdict.spec)."""
    from app.verdict import sessions as store
    from app.verdict.scenarios import load_scenario

    scenario = load_scenario(cfg.scenario)
    if not cfg.modes and not cfg.llama_server and not cfg.target_url and not cfg.serve:
        raise ValueError("nothing to measure: give --modes, --llama-server, --serve or --target")
    if cfg.serve and start_serve is None:
        raise ValueError("--serve needs a way to start hearth serve (the command line passes one)")
    # The catalog names a model file by its stem: Apply finds the model under the same name.
    model_name = Path(cfg.model_path).stem if cfg.model_path else "target"
    with sessions() as s:
        class_policies = store.policies(s)
    runner_plan = plan_for(cfg, scenario)
    for lv, note in runner_plan.notes.items():
        log(f"level {lv}: {note}")
    for line in runner_plan.skipped:
        log(f"not measured: {line}")
    if not runner_plan.groups:
        raise ValueError("nothing can be measured here: " + "; ".join(runner_plan.skipped))
    base = Constants(cfg.model_path, model_name, cfg.n_ctx, cfg.parallel, cfg.n_batch, cfg.threads,
                     cfg.gpu_layers, cfg.token_budget)
    total = runner_plan.runs(cfg.repeats)
    targets: list[Target] = []
    session_id = None
    runs: list[RunResult] = []
    done = [0]

    def on_run(run: RunResult) -> None:
        with sessions() as s:
            store.save_run(s, session_id, run)
        done[0] += 1
        if progress is not None:
            progress(run, done[0], total)

    try:
        for group in runner_plan.groups:
            _start_targets(targets, cfg, base, group, model_name, log, start_serve)
            if not targets:
                continue
            for t in targets:
                warm_up(t)
            # Prompts are cut with a runner's tokenizer (serve's runner: its gateway has none of its own).
            cutting = next((t for t in targets if t.kind != "external"), targets[0])
            cutter = http_cutter(cutting.metrics_url or cutting.url, cutting.metrics_headers)
            if session_id is None:
                props = None
                if targets[0].kind == "hearth":
                    props = httpx.get(f"{targets[0].url}/props", timeout=10).json()
                constants = describe_constants(cfg, scenario, model_name, class_policies, cutter.exact, props,
                                               runner_plan)
                with sessions() as s:
                    session_id = store.create_session(s, scenario.name, model_name, constants)
            group_runs = replay(scenario, targets, list(group.levels), class_policies, cutter, progress=on_run,
                                repeats=cfg.repeats, once_levels=group.once_levels)
            with sessions() as s:
                for run in group_runs:
                    if "near_ties" in run.summary and run.run_id is not None:
                        store.save_summary(s, run)
            runs += group_runs
            stop_targets(targets)
            targets = []
    except BaseException as exc:
        if session_id is not None:
            with sessions() as s:
                store.finish_session(s, session_id, None, error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        stop_targets(targets)
    verdict, traffic = _judge(cfg, sessions, session_id, model_name, runs, class_policies, runner_plan)
    return BenchOutcome(session_id, constants, runs, verdict, traffic)


def _start_targets(targets: list[Target], cfg: BenchConfig, base: Constants, group: RunnerGroup, model_name: str,
                   log: Callable[[str], None], start_serve: Callable[[Constants, str | None], Target] | None) -> None:
    """Start one group's runners, stock llama-server, the external target and serve, into `targets` as each starts
    (so the caller stops those that started when a later one fails)."""
    from dataclasses import replace

    c = replace(base, n_ctx=group.n_ctx, parallel=group.slots, n_batch=_batch_for(cfg.n_batch, group.slots))
    for mode in group.modes:
        for arm in group.spec:
            log(f"starting hearth runner ({label(mode, arm)}, {group.slots} slots, {group.n_ctx} KV cells)")
            targets.append(start_hearth(c, mode, arm))
    if group.llama_server:
        for arm in group.llama_spec:
            log(f"starting llama-server ({label('llama-server', arm)}, {group.slots} slots)")
            targets.append(start_llama_server(c, cfg.llama_server, arm))
    if cfg.target_url and group.external:
        targets.append(external_target(cfg.target_url, model_name))
    if cfg.serve and group.external:
        for arm in cfg.arms():
            log(f"starting hearth serve ({label('serve', arm)}: "
                f"{'default settings' if arm in (None, 'auto') else 'speculation ' + arm}, fresh data folder)")
            serve = start_serve(base, arm)  # type: ignore[misc]
            serve.label = label(serve.label, arm)
            targets.append(serve)


def _judge(cfg: BenchConfig, sessions, session_id: int, model_name: str, runs: list[RunResult], class_policies: dict,
           runner_plan: RunnerPlan) -> tuple:
    """Decide on the stored runs with the household's settings, traffic and current runner settings; finish the
    session with the verdict. Returns (verdict, traffic)."""
    from app.store.settings import all_settings
    from app.verdict import sessions as store
    from app.verdict.decide import decide, thresholds_from
    from app.verdict.overlap import traffic as read_traffic

    with sessions() as s:
        t = thresholds_from(all_settings(s))
        traffic = read_traffic(s, cfg.traffic_days, burst_overlap=t.burst_overlap)
        current = store.current_runner_settings(s, model_name)
        verdict = decide(store.evidence(median_runs(runs)), class_policies, t, traffic, current, runner_plan.notes,
                         every_rep=store.evidence(runs))
        store.finish_session(s, session_id, verdict.as_dict())
    return verdict, traffic
