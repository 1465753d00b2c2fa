"""`hearth bench ceiling`: the serving path's token ceiling against stock llama-server, on a model whose decode is free.

A tiny random-weight model (`hearth models random tiny`) decodes in microseconds, so what the table shows is
everything around llama.cpp: Python per token, the HTTP stream, serve's relay. Each target is started with the same
model, slots (-np), context and threads; each row streams `--tokens` tokens per stream, best of `--repeats`, and
reads the CPU seconds every process (its tree: gunicorn arbiter and worker) spent over all those runs.
"""

from __future__ import annotations

import http.client
import json
import re
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from app.devtools.serving.gateway_bench import run_together
from app.llama_tools import tools_cache_dir

TARGETS = ("llama-server", "runner", "serve")
# A streamed event's usage (OpenAI's include_usage chunk, or the final chunk's usage).
_USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')


def default_llama_server() -> str:
    """The cached stock llama-server of the pinned llama.cpp (scripts/build_llama_tools.sh)."""
    return str(tools_cache_dir() / "bin" / "llama-server")


def add_arguments(parser) -> None:
    """The flags of `hearth bench ceiling`."""
    parser.add_argument("--model", help="GGUF (default: a tiny random model written to a temporary folder)")
    parser.add_argument("--llama-server", default=None, help="stock llama-server binary (default: the cached "
                        "~/.cache/hearth/llama-tools/<version>/bin/llama-server)")
    parser.add_argument("--streams", default="1,8,32", help="concurrent stream counts (default %(default)s); "
                        "up to 8 run on -np 8, more on -np <streams>")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per stream (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row, the best tok/s kept, CPU summed over "
                        "all (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds over every target, the order reversed each "
                        "round; with more than one, each row's tok/s is the median of the rounds' bests (default "
                        "%(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads of every target (default %(default)s)")
    parser.add_argument("--ctx-per-slot", type=int, default=512, help="context per slot (default %(default)s)")
    parser.add_argument("--targets", default=",".join(TARGETS), help="which of %(default)s to run")
    parser.add_argument("--drafts", action="store_true", help="let hearth runners draft (n-gram lookup: serve's "
                        "runner does by default, a random model's loops hit often); default: every request sends "
                        "speculative.n_max 0, so no target drafts, as stock llama-server without a draft model")
    parser.add_argument("--json", dest="json_path", help="write the rows here")


@dataclass
class Row:
    """One target at one stream count: its best run."""

    target: str
    streams: int
    tok_s: float  # the best run's
    tokens: int  # generated over all the runs
    # process name → CPU seconds over all the runs: a run of 256 tokens lasts some 30 ms, and a process's CPU time
    # moves in 10 ms ticks, so only the sum over the runs measures to a few percent
    cpu_s: dict[str, float] = field(default_factory=dict)
    runs_tok_s: list[float] = field(default_factory=list)  # every run's, the best one among them

    def cpu_per_1k(self, name: str) -> float:
        """CPU seconds the process `name` spent per 1,000 tokens generated."""
        return self.cpu_s[name] * 1000 / self.tokens if self.tokens else 0.0


def tree_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and all their descendants (gone ones count zero)."""
    seen, total = set(), 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
    return total


def _one_stream(url: str, headers: dict, body: bytes, out: list, i: int) -> None:
    """POST one streamed completion and read it to the end; out[i] = completion tokens (usage, else events)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    try:
        conn.request("POST", u.path, body=body, headers={"Content-Type": "application/json", **headers})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {r.read()[:300]!r}")
        chunks = []
        while True:
            b = r.read1(65536)
            if not b:
                break
            chunks.append(b)
        data = b"".join(chunks)
        used = _USAGE.findall(data)
        out[i] = int(used[-1]) if used else data.count(b"data: {")
    finally:
        conn.close()


def run_streams(url: str, headers: dict, model: str, n: int, tokens: int, drafts: bool = False) -> tuple[float, int]:
    """n concurrent streams of `tokens` tokens each: (tok/s over the whole run, tokens generated)."""
    counts = [0] * n
    errors: list[BaseException] = []
    # llama-server's per-request field, which the hearth runner reads too (serve passes it on).
    no_drafts = {} if drafts else {"speculative.n_max": 0}

    def one(i: int) -> None:
        body = json.dumps({"model": model, "prompt": f"Story {i}:", "max_tokens": tokens, "ignore_eos": True,
                           "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                           **no_drafts}).encode()
        try:
            _one_stream(url, headers, body, counts, i)
        except BaseException as exc:  # reported below: a failed stream must not pass for a fast one
            errors.append(exc)

    elapsed = run_together(one, n)
    if errors:
        raise errors[0]
    return sum(counts) / elapsed, sum(counts)


@dataclass
class Started:
    """A target the bench started: where to send, with what, the processes whose CPU counts, and how to stop it."""

    url: str
    headers: dict
    processes: Callable[[], dict[str, list[int]]]  # name → root pids (each counted with its descendants)
    stop: Callable[[], None]


def start_target(target: str, model_path: str, parallel: int, ctx: int, threads: int, binary: str,
                 tmp: Path) -> Started:
    """Start llama-server, a hearth runner, or hearth serve (which starts its runner) with these constants."""
    from app.residency.runner_spec import RunnerSpec
    from app.residency.supervisor import RunnerProcess

    if target in ("llama-server", "runner"):
        kind = "llama-server" if target == "llama-server" else "hearth"
        spec = RunnerSpec(model_name=Path(model_path).stem, model_path=model_path, kind=kind, binary_path=binary if
                          kind == "llama-server" else None, n_ctx=ctx, parallel=parallel, threads=threads)
        proc = RunnerProcess(spec).start(180)
        return Started(proc.url, proc.headers, lambda: {target: [proc.pid]}, proc.stop)
    from app.devtools.serve_process import ServeProcess, prepare_data

    data, models = tmp / f"data-{parallel}", tmp / f"models-{parallel}"
    models.mkdir(exist_ok=True)
    # One token stands for every client: it may hold the whole class (member_class_share 1).
    tokens = prepare_data(data, settings={"runner_ctx": ctx, "runner_parallel": parallel, "runner_threads": threads,
                                          "member_class_share": 1.0},
                          classes={"chat": {"max_concurrent": 64, "max_queue": 64}}, tokens=[("bench", "chat", [])])
    serve = ServeProcess(data, models, Path(model_path), tmp / f"serve-{parallel}.log")

    def processes() -> dict[str, list[int]]:
        runners = serve.runner_arbiters()
        runner_pids = {p.pid for p in serve.runner_processes()}
        own = [p.pid for p in psutil.Process(serve.proc.pid).children(recursive=True) if p.pid not in runner_pids]
        # serve's own tree less its runners: the arbiter alone, plus its worker(s) as separate roots.
        return {"serve": [serve.proc.pid], "serve-only": own, "runner": [p.pid for p in runners]}

    return Started(serve.url, {"Authorization": f"Bearer {tokens['bench']}"}, processes, serve.stop)


def _cpu(processes: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far per named process; serve's own = its whole tree less its runner's."""
    out = {name: tree_cpu_s(pids) for name, pids in processes.items() if name != "serve-only"}
    if "serve" in out:
        out["serve"] -= out.get("runner", 0.0)
    return out


def measure(started: Started, model: str, n: int, tokens: int, repeats: int, drafts: bool = False) -> Row:
    """Best of `repeats` runs of n streams, with the CPU each process spent over all of them."""
    procs = started.processes()
    before = _cpu(procs)
    rates, total = [], 0
    for _ in range(repeats):
        tok_s, got = run_streams(started.url + "/v1/completions", started.headers, model, n, tokens, drafts)
        rates.append(tok_s)
        total += got
    after = _cpu(procs)
    return Row("", n, max(rates), total, {k: after[k] - before[k] for k in after}, rates)


def merge_rounds(rounds: list[list[Row]]) -> list[Row]:
    """One row per target and stream count from several rounds: tok/s the median of the rounds' bests (each round's
    best listed in runs_tok_s), tokens and CPU seconds summed over all of them."""
    merged: dict[tuple[str, int], Row] = {}
    for rows in rounds:
        for r in rows:
            m = merged.setdefault((r.target, r.streams), Row(r.target, r.streams, 0.0, 0, {}, []))
            m.runs_tok_s.append(r.tok_s)
            m.tokens += r.tokens
            for name, cpu in r.cpu_s.items():
                m.cpu_s[name] = m.cpu_s.get(name, 0.0) + cpu
    for m in merged.values():
        m.tok_s = statistics.median(m.runs_tok_s)
    return list(merged.values())


def run_ceiling(model_path: str, binary: str, stream_counts: list[int], tokens: int, repeats: int, threads: int,
                ctx_per_slot: int, targets: list[str], drafts: bool = False, rounds: int = 1) -> list[Row]:
    """Every target at every stream count, grouped by slot count so each target starts once per group and round;
    rounds alternate the targets' order (a box's drift falls on each alike) and are merged by merge_rounds."""
    if rounds > 1:
        return merge_rounds([run_ceiling(model_path, binary, stream_counts, tokens, repeats, threads, ctx_per_slot,
                                         targets if i % 2 == 0 else targets[::-1], drafts) for i in range(rounds)])
    groups: dict[int, list[int]] = {}
    for n in stream_counts:
        groups.setdefault(max(8, n), []).append(n)
    rows = []
    name = Path(model_path).stem  # serve's catalog names a model after its file
    with tempfile.TemporaryDirectory(prefix="hearth-ceiling-") as tmp:
        for parallel, counts in sorted(groups.items()):
            for target in targets:
                print(f"  {target} -np {parallel} ...", file=sys.stderr, flush=True)
                started = start_target(target, model_path, parallel, parallel * ctx_per_slot, threads, binary,
                                       Path(tmp))
                try:
                    run_streams(started.url + "/v1/completions", started.headers, name, 1, 16)  # warm (serve: load)
                    for n in counts:
                        row = measure(started, name, n, tokens, repeats, drafts)
                        row.target = target
                        rows.append(row)
                finally:
                    started.stop()
    return rows


def table(rows: list[Row]) -> str:
    """The markdown table: tok/s, the ratio to llama-server, CPU seconds per 1,000 tokens of each process."""
    stock = {r.streams: r.tok_s for r in rows if r.target == "llama-server"}
    lines = ["| path | streams | tok/s | × llama-server | runs (tok/s) | CPU s / 1k tokens |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r.streams, TARGETS.index(r.target))):
        ratio = f"{r.tok_s / stock[r.streams]:.2f}×" if stock.get(r.streams) else "–"
        cpu = ", ".join(f"{name} {r.cpu_per_1k(name):.3f}" for name in r.cpu_s)
        runs = " ".join(f"{x:,.0f}" for x in r.runs_tok_s)
        lines.append(f"| {r.target} | {r.streams} | {r.tok_s:,.0f} | {ratio} | {runs} | {cpu} |")
    return "\n".join(lines)


def run(args) -> int:
    """`hearth bench ceiling`: make the tiny model if none was given, run every target, print the table."""
    binary = args.llama_server or default_llama_server()
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise SystemExit(f"hearth bench ceiling: unknown target {unknown[0]!r}; choose from {', '.join(TARGETS)}")
    if "llama-server" in targets and not Path(binary).is_file():
        raise SystemExit(f"hearth bench ceiling: no llama-server at {binary}; pass --llama-server PATH "
                         f"or leave it out with --targets runner,serve")
    counts = [int(s) for s in args.streams.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="hearth-ceiling-model-") as tmp:
        model = args.model
        if not model:
            from app.devtools.gguf_shapes import SHAPES, make_model

            model = make_model(SHAPES["tiny"], Path(tmp) / "tiny.gguf")["path"]
        rows = run_ceiling(model, binary, counts, args.tokens, args.repeats, args.threads, args.ctx_per_slot, targets,
                           args.drafts, args.rounds)
    if args.rounds > 1:
        print(f"{args.rounds} rounds, the targets' order reversed each round: tok/s the median of the rounds' bests "
              f"(runs: each round's best), CPU over every run")
    print(f"{args.tokens} tokens per stream, tok/s best of {args.repeats}, CPU over all {args.repeats}; threads "
          f"{args.threads}, context {args.ctx_per_slot} per slot, -np 8 (or the stream count above 8); "
          f"{'hearth runners draft as configured' if args.drafts else 'no drafting (speculative.n_max 0)'}")
    cpu_name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), "?") if Path("/proc/cpuinfo").is_file() else "?"
    print(f"machine: {cpu_name}, {psutil.cpu_count()} cores, load average {psutil.getloadavg()[0]:.2f} at the end")
    print(table(rows))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    return 0
