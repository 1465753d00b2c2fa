"""`hearth bench replay`: a scenario replayed over HTTP against runners in each mode (and any other server).

Targets are a hearth runner started per mode (continuous, serial, static) with model, quantisation,
context, slots, threads and hardware held constant, a stock llama-server started with the same
settings, or any OpenAI-compatible URL. One client measures all of them in the same run, level by
level with the targets interleaved, so drift on a shared machine hits every target alike.

Per request the client keeps raw timings (seconds from the run's start); during each run a sampler
reads the server's /metrics (KV cells, preemptions, running/waiting) and the device's utilisation.
`summarise` derives every figure from those raw rows, live and again from the store.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil

from app.exposition import Scrape, parse_exposition
from app.hardware import cpu_has_amx, machine, nvml_gpus
from app.paths import sha256_of
from app.policy import MODES, SLO_HEADER, ClassPolicy, slo_header
from app.telemetry.stats import median
from app.verdict.results import RunResult, median_runs, request_times, summarise
from app.verdict.runners import ONCE_MODES, RunnerPlan, plan_runners
from app.verdict.scenarios import (
    PlannedRequest,
    PromptCutter,
    Scenario,
    plan,
    script_size,
)

SAMPLE_INTERVAL_S = 0.2
HEARTH_MODES = MODES


@dataclass
class Target:
    """A server the client measures: a runner the bench started, or a URL it was given."""

    label: str  # what the tables call it: the mode for hearth runners, "llama-server", "target"
    url: str
    kind: str  # "hearth", "llama-server" or "external"
    model: str  # the model name sent in requests
    pid: int | None = None  # the process whose CPU is the device's utilisation
    threads: int | None = None
    process: object = None  # RunnerProcess to stop at the end
    slots: int | None = None  # sequence slots it was started with; None when the bench did not start it
    headers: dict | None = None  # sent with every request (a gateway's token)
    metrics_url: str | None = None  # where the sampler reads KV and queue figures (default: url)

    @property
    def mode(self) -> str:
        """The scheduling mode for hearth runners; the server kind otherwise."""
        return self.label


class _Utilisation:
    """The device's busy share: GPU utilisation via NVML when present, else the runner's CPU."""

    def __init__(self, pid: int | None, threads: int | None):
        self._nvml = nvml_gpus()
        self.source = "gpu" if self._nvml else "cpu"
        self._procs: list[psutil.Process] = []
        self._capacity = 100.0 * (threads or psutil.cpu_count() or 1)
        if pid is not None:
            try:
                root = psutil.Process(pid)
                self._procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                self._procs = []
        self.read()  # cpu_percent's first call only sets the baseline

    def read(self) -> float | None:
        """Busy share 0..1 since the previous read."""
        if self._nvml is not None:
            pynvml, handles = self._nvml
            return max(pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles) / 100
        if self._procs:
            total = 0.0
            for p in self._procs:
                try:
                    total += p.cpu_percent(None)
                except psutil.NoSuchProcess:
                    pass
            return min(1.0, total / self._capacity)
        return psutil.cpu_percent(None) / 100


class _Client:
    """Sends one planned request, streamed, and keeps its raw timings."""

    def __init__(self, target: Target, t0: float, http: httpx.Client, policies: dict[str, ClassPolicy]):
        self.target = target
        self.t0 = t0
        self.http = http
        self.policies = policies
        self.lock = threading.Lock()
        self.in_flight = 0
        self.before_first_token = 0

    def send(self, req: PlannedRequest) -> dict:
        """POST /v1/completions (stream) and return the request's raw row."""
        policy = self.policies.get(req.class_name)
        priority = policy.priority if policy else 1
        body = {
            "model": self.target.model, "prompt": req.text, "max_tokens": req.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": True,
            # A stock llama-server would otherwise reuse a slot's KV prefix from an earlier run.
            "cache_prompt": False,
        }
        if self.target.kind == "serve":
            # As a family app asks `hearth serve`: its class by name; the gateway adds priority and targets.
            headers = {**(self.target.headers or {}), "X-Hearth-Class": req.class_name}
        else:
            # Hearth's extras (a stock server ignores them), as the gateway's relay sends them to a runner;
            # the class's targets drive the engine's budget and preemption.
            body.update(priority=priority, hearth_class=req.class_name)
            headers = {**(self.target.headers or {}), **({SLO_HEADER: slo_header(policy)} if policy else {})}
        row = {"idx": req.idx, "class_name": req.class_name, "priority": priority, "sent_s": None,
               "first_token_s": None, "end_s": None, "prompt_tokens": None, "completion_tokens": None,
               "max_tokens": req.max_tokens, "status": "ok", "error": None, "server_timings": None}
        pieces = 0
        with self.lock:
            self.in_flight += 1
            self.before_first_token += 1
        first = True
        try:
            row["sent_s"] = time.monotonic() - self.t0
            with self.http.stream("POST", f"{self.target.url}/v1/completions", json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data.strip() == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise RuntimeError(str(chunk["error"].get("message", chunk["error"]))[:300])
                    text = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
                    if text:
                        pieces += 1
                        if first:
                            row["first_token_s"] = time.monotonic() - self.t0
                            first = False
                            with self.lock:
                                self.before_first_token -= 1
                    if chunk.get("usage"):
                        row["prompt_tokens"] = chunk["usage"].get("prompt_tokens")
                        row["completion_tokens"] = chunk["usage"].get("completion_tokens")
                    if chunk.get("timings"):
                        row["server_timings"] = chunk["timings"]
            row["end_s"] = time.monotonic() - self.t0
            if row["completion_tokens"] is None:
                row["completion_tokens"] = pieces
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            row["status"] = "error"
            row["error"] = str(exc) or type(exc).__name__
            row["end_s"] = time.monotonic() - self.t0
        finally:
            with self.lock:
                self.in_flight -= 1
                if first:
                    self.before_first_token -= 1
        return row


def run_level(target: Target, planned: list[PlannedRequest], policies: dict[str, ClassPolicy],
              level: int, timeout_s: float = 900) -> RunResult:
    """Send the planned requests at their times, sample the server meanwhile; raw rows and samples."""
    rows: list[dict | None] = [None] * len(planned)
    samples: list[dict] = []
    util = _Utilisation(target.pid, target.threads)
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10),
                      limits=httpx.Limits(max_connections=len(planned) + 4)) as http:
        t0 = time.monotonic()
        client = _Client(target, t0, http, policies)
        done = threading.Event()

        def one(i: int, req: PlannedRequest) -> None:
            time.sleep(max(0.0, t0 + req.at_s - time.monotonic()))
            rows[i] = client.send(req)

        def sample() -> None:
            with httpx.Client(timeout=2.0) as mclient:
                while not done.wait(SAMPLE_INTERVAL_S):
                    s = {"t_s": time.monotonic() - t0, "in_flight": client.in_flight,
                         "before_first_token": client.before_first_token, "util": util.read()}
                    try:
                        r = mclient.get(f"{target.metrics_url or target.url}/metrics")
                        values = parse_exposition(r.text) if r.status_code == 200 else Scrape()
                    except (httpx.HTTPError, ValueError):
                        # A sample without server figures; the request timings still count.
                        values = Scrape()
                    s["kv_used"] = values.first("hearth:kv_cells_used", "llamacpp:kv_cache_tokens")
                    s["kv_total"] = values.value("hearth:kv_cells_total")
                    s["kv_util"] = values.value("llamacpp:kv_cache_usage_ratio")
                    if s["kv_used"] is not None and s["kv_total"]:
                        s["kv_util"] = s["kv_used"] / s["kv_total"]
                    s["running"] = values.first("hearth:requests_running", "llamacpp:requests_processing")
                    s["waiting"] = values.first("hearth:requests_waiting", "llamacpp:requests_deferred")
                    s["preemptions_total"] = values.value("hearth:preemptions_total")
                    samples.append(s)

        sampler = threading.Thread(target=sample, name="bench-sampler", daemon=True)
        sampler.start()
        threads = [threading.Thread(target=one, args=(i, r), daemon=True) for i, r in enumerate(planned)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, t0 + timeout_s - time.monotonic()))
        done.set()
        sampler.join(5)
    lost = [planned[i].idx for i, r in enumerate(rows) if r is None]
    if lost:
        raise RuntimeError(f"requests {lost} did not finish within {timeout_s} s on {target.label}")
    run = RunResult(target.label, target.kind, level, [r for r in rows if r is not None], samples, slots=target.slots)
    run.summary = summarise(run.requests, run.samples, policies)
    return run


# --- targets ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Constants:
    """What every target is started with."""

    model_path: str
    model_name: str
    n_ctx: int
    parallel: int
    n_batch: int
    threads: int
    gpu_layers: int = 0
    token_budget: int | None = None


def start_hearth(c: Constants, mode: str, timeout_s: float = 180) -> Target:
    """A hearth runner in `mode` with the constants; waits until it serves."""
    from app.residency.supervisor import RunnerProcess, RunnerSpec

    extra = ("--budget", str(c.token_budget)) if c.token_budget else ()
    spec = RunnerSpec(model_name=c.model_name, model_path=c.model_path, kind="hearth", n_ctx=c.n_ctx,
                      parallel=c.parallel, n_batch=c.n_batch, threads=c.threads, gpu_layers=c.gpu_layers,
                      mode=mode, extra_args=extra)
    proc = RunnerProcess(spec).start(timeout_s)
    return Target(mode, proc.url, "hearth", c.model_name, pid=proc.pid, threads=c.threads, process=proc,
                  slots=c.parallel)


def start_llama_server(c: Constants, binary: str, timeout_s: float = 180) -> Target:
    """Stock llama-server with the same model, context, slots (-np), batch and threads."""
    from app.residency.supervisor import RunnerProcess, RunnerSpec

    spec = RunnerSpec(model_name=c.model_name, model_path=c.model_path, kind="llama-server", binary_path=binary,
                      n_ctx=c.n_ctx, parallel=c.parallel, n_batch=c.n_batch, threads=c.threads,
                      gpu_layers=c.gpu_layers)
    proc = RunnerProcess(spec).start(timeout_s)
    return Target("llama-server", proc.url, "llama-server", c.model_name, pid=proc.pid, threads=c.threads,
                  process=proc, slots=c.parallel)


def external_target(url: str, model: str) -> Target:
    """Any OpenAI-compatible server; its device utilisation is the whole machine's."""
    return Target("target", url.rstrip("/"), "external", model)


def stop_targets(targets: list[Target]) -> None:
    """Stop the runners the bench started."""
    for t in targets:
        if t.process is not None:
            t.process.stop()


def http_cutter(url: str) -> PromptCutter:
    """Prompt cutting with the server's /tokenize and /detokenize; estimated lengths if it has neither."""
    try:
        r = httpx.post(f"{url}/tokenize", json={"content": "hello"}, timeout=10)
        d = httpx.post(f"{url}/detokenize", json={"tokens": r.json()["tokens"]}, timeout=10)
        d.json()["content"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return PromptCutter()

    def tokenize(text: str) -> list[int]:
        return httpx.post(f"{url}/tokenize", json={"content": text}, timeout=60).json()["tokens"]

    def detokenize(tokens: list[int]) -> str:
        return httpx.post(f"{url}/detokenize", json={"tokens": tokens}, timeout=60).json()["content"]

    return PromptCutter(tokenize, detokenize)


def serve_ready(target: Target) -> None:
    """After the warm-up has loaded serve's runner: its slots, and its /metrics for the sampler."""
    target.metrics_url = target.process.runner_url()
    props = httpx.get(f"{target.metrics_url}/props", timeout=10).json()
    target.slots = props.get("total_slots")


def warm_up(target: Target) -> None:
    """One short request, discarded: the first request of a process pays for cold caches (serve: loads its model)."""
    r = httpx.post(f"{target.url}/v1/completions", timeout=300, headers=target.headers,
                   json={"model": target.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0})
    if target.kind == "serve":
        if r.status_code != 200:
            raise RuntimeError(f"hearth serve did not answer the warm-up: HTTP {r.status_code}: {r.text[:300]}")
        serve_ready(target)


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
        for rep in range(repeats):
            for target in (here if rep % 2 == 0 else list(reversed(here))):
                run = run_level(target, planned, policies, level)
                run.rep = rep
                results.append(run)
                if progress is not None:
                    progress(run)
    return results


def _f(v, spec: str = ".1f", scale: float = 1.0) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v * scale if scale != 1.0 else v, spec)


def format_table(results: list[RunResult]) -> str:
    """The per target × level table, plus per-class p95s."""
    head = (f"{'target':<13}{'L':>3}{'slots':>6}{'gen tok/s':>10}{'prm tok/s':>10}{'TTFT p50':>9}{'TTFT p95':>9}"
            f"{'TPOT p50':>9}{'done p50':>9}{'done p95':>9}{'KV mean':>8}{'KV peak':>8}{'preempt':>8}"
            f"{'Jain':>6}{'util':>6}{'gap':>6}{'err':>4}")
    lines = [head, "-" * len(head)]
    for r in results:
        s = r.summary
        lines.append(
            f"{r.target:<13}{r.level:>3}{_f(r.slots, 'd'):>6}{_f(s['gen_tok_s']):>10}{_f(s['prompt_tok_s'], '.0f'):>10}"
            f"{_f(s['ttft_p50_ms'], '.0f'):>9}{_f(s['ttft_p95_ms'], '.0f'):>9}{_f(s['tpot_p50_ms'], '.0f'):>9}"
            f"{_f(s['completion_p50_ms'], '.0f'):>9}{_f(s['completion_p95_ms'], '.0f'):>9}"
            f"{_f(s['kv_mean_util'], '.0f', 100):>7}%{_f(s['kv_peak_util'], '.0f', 100):>7}%"
            f"{_f(s['preemptions'], 'd'):>8}{_f(s['jain_fairness'], '.2f'):>6}{_f(s['util_mean'], '.0f', 100):>5}%"
            f"{_f(s['util_gap_share'], '.0f', 100):>5}%{s['errors']:>4}"
        )
    lines.append("")
    lines.append("per class, p95 ms (TTFT / completion) and SLO attainment:")
    for r in results:
        parts = [f"{n} {_f(c['ttft_p95_ms'], '.0f')}/{_f(c['completion_p95_ms'], '.0f')}"
                 f" slo {_f(c['slo_attainment'], '.0f', 100)}%" for n, c in r.summary["per_class"].items()]
        lines.append(f"  {r.target:<13}L={r.level:<3}S={_f(r.slots, 'd'):<4}" + "; ".join(parts))
    return "\n".join(lines)


def comparison(results: list[RunResult]) -> list[dict]:
    """Each hearth mode against the reference server (llama-server, else --target), same level, slots and repetition.

    Ratios are taken within one repetition (same prompts, neighbouring in time); with repeats the
    row holds the median of each ratio and all of them.
    """
    for ref_label in ("llama-server", "target"):
        refs = {(r.level, r.slots, r.rep): r for r in results if r.target == ref_label}
        if refs:
            break
    else:
        return []
    pairs: dict[tuple[str, int, int | None], list[dict]] = {}
    for r in results:
        # An external reference was not started by the bench: its slots are unknown, any will do.
        ref = refs.get((r.level, r.slots, r.rep)) or refs.get((r.level, None, r.rep))
        if ref is None and r.target == "serve":
            # serve sized its own runner: compare with the reference at the same level and repetition.
            ref = next((v for k, v in refs.items() if k[0] == r.level and k[2] == r.rep), None)
        if ref is None or (r.target not in HEARTH_MODES and r.target != "serve"):
            continue
        a, b = r.summary, ref.summary
        one = {"gen_tok_s_ratio": _ratio(a["gen_tok_s"], b["gen_tok_s"]), "per_class": {}}
        for name, c in a["per_class"].items():
            rc = b["per_class"].get(name, {})
            one["per_class"][name] = {
                "ttft_p95_ratio": _ratio(c.get("ttft_p95_ms"), rc.get("ttft_p95_ms")),
                "completion_p95_ratio": _ratio(c.get("completion_p95_ms"), rc.get("completion_p95_ms")),
                # The slowest request of the class, ours over theirs: "finishes within 1.2×" is about all of them.
                "completion_max_ratio": _ratio(_max_done(r.requests, name), _max_done(ref.requests, name)),
            }
        pairs.setdefault((r.target, r.level, r.slots), []).append(one)
    out = []
    for (mode, level, slots), ones in pairs.items():
        row = {"mode": mode, "reference": ref_label, "level": level, "slots": slots, "repeats": len(ones),
               "gen_tok_s_ratio": median([o["gen_tok_s_ratio"] for o in ones]),
               "gen_tok_s_ratios": [o["gen_tok_s_ratio"] for o in ones], "per_class": {}}
        for name in ones[0]["per_class"]:
            row["per_class"][name] = {
                key: median([o["per_class"][name][key] for o in ones if name in o["per_class"]])
                for key in ("ttft_p95_ratio", "completion_p95_ratio", "completion_max_ratio")}
            row["per_class"][name]["ttft_p95_ratios"] = [o["per_class"][name]["ttft_p95_ratio"] for o in ones
                                                         if name in o["per_class"]]
        out.append(row)
    return out


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _max_done(rows: list[dict], class_name: str) -> float | None:
    done = [request_times(r)["completion_ms"] for r in rows if r["class_name"] == class_name]
    done = [d for d in done if d is not None]
    return max(done) if done else None


def format_comparison(rows: list[dict]) -> str:
    """The comparison as the CLI prints it."""
    lines = []
    for row in rows:
        parts = [f"{n}: TTFT p95 {_f(c['ttft_p95_ratio'], '.3f')}×, done p95 {_f(c['completion_p95_ratio'], '.2f')}×,"
                 f" slowest {_f(c['completion_max_ratio'], '.2f')}×" for n, c in row["per_class"].items()]
        reps = f" (median of {row['repeats']})" if row["repeats"] > 1 else ""
        slots = f", {row['slots']} slots" if row.get("slots") else ""
        lines.append(f"  {row['mode']} / {row['reference']} at L={row['level']}{slots}{reps}: generated tok/s "
                     f"{_f(row['gen_tok_s_ratio'], '.2f')}×; " + "; ".join(parts))
    return "\n".join(lines)


# --- a whole bench session ---------------------------------------------------------------------

@dataclass(frozen=True)
class BenchConfig:
    """What `hearth bench replay` (or the dashboard's Start) asked for."""

    scenario: str = "household"
    levels: tuple[int, ...] = (1, 2, 4, 8)
    modes: tuple[str, ...] = HEARTH_MODES
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
    return plan_runners(levels, cfg.modes, cfg.parallel, cfg.n_ctx, axis, bool(cfg.llama_server),
                        bool(cfg.target_url) + int(cfg.serve), runner_bytes, headroom, memory)


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
        "repack": not cpu_has_amx(), "kv_unified": True,
        "sampling": "temperature 0, ignore_eos (fixed output lengths), cache_prompt off",
        "prompt_lengths": "exact (target's tokenizer)" if cutter_exact else "estimated (4 chars/token)",
        "llama_server": cfg.llama_server, "target_url": cfg.target_url, "serve": cfg.serve,
        "runner_plan": runner_plan.as_dict() if runner_plan else None,
        "classes": {n: asdict(p) for n, p in class_policies.items()},
        "machine": machine(),
    }


def run_bench(cfg: BenchConfig, sessions, progress: Callable[[RunResult, int, int], None] | None = None,
              log: Callable[[str], None] = lambda line: None,
              start_serve: Callable[[Constants], Target] | None = None) -> BenchOutcome:
    """Start each group of runners, replay, store every run as it ends, judge; stops what it started.

    With cfg.serve, start_serve (app.devtools.serve_process.serve_target) starts the `hearth serve` target."""
    from dataclasses import replace

    from app.store.settings import all_settings
    from app.verdict import sessions as store
    from app.verdict.decide import decide, thresholds_from
    from app.verdict.overlap import traffic as read_traffic
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
            c = replace(base, n_ctx=group.n_ctx, parallel=group.slots, n_batch=_batch_for(cfg.n_batch, group.slots))
            for mode in group.modes:
                log(f"starting hearth runner ({mode}, {group.slots} slots, {group.n_ctx} KV cells)")
                targets.append(start_hearth(c, mode))
            if group.llama_server:
                log(f"starting llama-server ({group.slots} slots)")
                targets.append(start_llama_server(c, cfg.llama_server))
            if cfg.target_url and group.external:
                targets.append(external_target(cfg.target_url, model_name))
            if cfg.serve and group.external:
                log("starting hearth serve (default settings, fresh data folder)")
                targets.append(start_serve(base))  # type: ignore[misc]
            if not targets:
                continue
            for t in targets:
                warm_up(t)
            # Prompts are cut with a runner's tokenizer (serve's runner: its gateway has none of its own).
            cutter = http_cutter(next((t.metrics_url or t.url for t in targets if t.kind != "external"), targets[0].url))
            if session_id is None:
                props = None
                if targets[0].kind == "hearth":
                    props = httpx.get(f"{targets[0].url}/props", timeout=10).json()
                constants = describe_constants(cfg, scenario, model_name, class_policies, cutter.exact, props,
                                               runner_plan)
                with sessions() as s:
                    session_id = store.create_session(s, scenario.name, model_name, constants)
            runs += replay(scenario, targets, list(group.levels), class_policies, cutter, progress=on_run,
                           repeats=cfg.repeats, once_levels=group.once_levels)
            stop_targets(targets)
            targets = []
    except BaseException as exc:
        if session_id is not None:
            with sessions() as s:
                store.finish_session(s, session_id, None, error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        stop_targets(targets)
    with sessions() as s:
        t = thresholds_from(all_settings(s))
        traffic = read_traffic(s, cfg.traffic_days, burst_overlap=t.burst_overlap)
        current = store.current_runner_settings(s, model_name)
        verdict = decide(store.evidence(median_runs(runs)), class_policies, t, traffic, current, runner_plan.notes)
        store.finish_session(s, session_id, verdict.as_dict())
    return BenchOutcome(session_id, constants, runs, verdict, traffic)


def format_plan(p: dict) -> list[str]:
    """The runner groups of a session's constants, one line each, for the CLI."""
    lines = []
    for g in p["groups"]:
        est = f", est. {g['estimate_bytes'] / 1024 ** 3:.2f} GiB" if g.get("estimate_bytes") else ""
        lines.append(f"  {g['slots']} slots, {g['n_ctx']} KV cells: levels {g['levels']}, "
                     f"modes {', '.join(g['modes']) or 'none'}{est}")
    lines += [f"  level {lv}: {note}" for lv, note in p["notes"].items()]
    lines += [f"  not measured: {line}" for line in p["skipped"]]
    lines.append(f"  memory check: {p['memory']}")
    return lines


def run_from_args(args, model_path: str, start_serve: Callable[[Constants], Target] | None = None) -> int:
    """`hearth bench replay`: run, print the constants, table, overlap and verdict; write JSON/CSV if asked."""
    import sys

    from tqdm import tqdm

    from app.paths import data_dir
    from app.store.db import open_store
    from app.verdict import sessions as store
    from app.verdict.decide import format_verdict
    from app.verdict.overlap import format_overlap
    from app.verdict.scenarios import ScenarioError, load_scenario

    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as exc:
        print(f"hearth bench replay: {exc}", file=sys.stderr)
        return 2
    modes = tuple(args.modes) if args.modes != ["none"] else ()
    llama = None
    if args.llama_server:
        llama = args.llama_server if args.llama_server != "auto" else str(_stock_llama_server())
    cfg = BenchConfig(scenario=args.scenario, levels=tuple(args.levels), modes=modes,
                      model_path=model_path, n_ctx=args.ctx, parallel=args.parallel,
                      n_batch=args.batch, token_budget=args.budget, threads=args.threads,
                      gpu_layers=args.gpu_layers, target_url=args.target, llama_server=llama, serve=args.serve,
                      traffic_days=args.days, repeats=args.repeats,
                      slots=tuple(args.slots) if getattr(args, "slots", None) else None)
    engine, sessions = open_store(data_dir())
    bar = tqdm(total=total_runs(cfg, scenario), desc="bench replay", unit="run", file=sys.stderr)

    def progress(run: RunResult, done: int, total: int) -> None:
        bar.total = total
        bar.set_postfix_str(f"{run.target} L={run.level} S={run.slots}: {_f(run.summary['gen_tok_s'])} tok/s")
        bar.update(1)

    from app.residency.supervisor import RunnerStartFailed

    try:
        outcome = run_bench(cfg, sessions, progress=progress, log=lambda line: bar.write(line, file=sys.stderr),
                            start_serve=start_serve)
    except (ValueError, RuntimeError, RunnerStartFailed) as exc:
        # RuntimeError: a target that did not answer (serve's warm-up, requests that never finished).
        print(f"hearth bench replay: {exc}", file=sys.stderr)
        engine.dispose()
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
    doc["traffic"] = outcome.traffic
    if args.json_path:
        store.write_json(doc, args.json_path)
        print(f"wrote {args.json_path}", file=sys.stderr)
    if args.csv_path:
        raw = store.write_csv(outcome.runs, args.csv_path)
        print(f"wrote {args.csv_path} and {raw}", file=sys.stderr)
    engine.dispose()
    return 0


def _stock_llama_server():
    """The llama-server built by scripts/build_llama_tools.sh for the pinned version."""
    from app.llama_tools import BUILD_SCRIPT, stock_llama_server, tools_cache_dir

    path = stock_llama_server()
    if path is None:
        raise SystemExit(f"hearth bench replay: llama-server is not built (looked in {tools_cache_dir() / 'bin'}); "
                         f"run {BUILD_SCRIPT}")
    return path
