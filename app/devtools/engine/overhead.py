"""`hearth bench overhead`: the engine's own Python work per iteration, with llama.cpp's decode taken out.

On a GPU one decode iteration of a small model takes a few milliseconds, so the Python work
around it (scheduling, filling the batch, sampling, streaming) decides whether the engine keeps
up. Here the real engine (app/engine/engine.py and scheduler.py) is driven by InstantModel, a
backend whose decode returns at once, at 1, 8, 32 and 64 sequences:

  plain         no timers inside: engine iterations per second and Python time per iteration;
  instrumented  the same run with timers around the phases: scheduling (admission, batch
                building, commit into the prefix cache), batch filling (the real BatchBuffer of
                app/engine/llama_model.py), sampling (the backend's sample call) and streaming
                (UTF-8 and stop strings, the Delta event); "other" is the rest of the iteration
                (locks, iteration stats, the loop around it).

With the real model (default: the embedded Gemma 3 270M, a 262k vocabulary) it also times one
sample call per sequence on real logits: greedy, greedy with ignore_eos, a sampler chain
(temperature, top-k/p, min-p), a chain with repetition penalties, and a JSON grammar.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from app.engine.engine import DECODE_OK, Engine
from app.engine.llama_model import BatchBuffer
from app.engine.request import Finished, SamplingParams
from app.engine.scheduler import Chunk
from app.hardware import machine
from app.telemetry.stats import median, quantile

LEVELS = (1, 8, 32, 64)
PROMPT_TOKENS = 32
GEN_TOKENS = 400
# Distinct word-like pieces, so streaming does real UTF-8 and stop-string work per token.
NUM_PIECES = 97
PHASES = ("scheduling", "batch_filling", "sampling", "streaming", "other")


class InstantModel:
    """A ModelBackend whose decode returns at once: only the engine's own Python work remains.

    The batch is filled by the real BatchBuffer (its cost is part of the engine's, not of
    llama.cpp's); sampling returns a token chosen from the slot and position, as cheap as a
    sampler can be, so the sampling figure is the engine's call overhead, and the real cost of
    choosing among 262k logits is measured on the real model (sample_costs).
    """

    def __init__(self, n_seq_max: int, n_ctx: int, n_batch: int = 512):
        self.n_seq_max = n_seq_max
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.n_swa = 0
        self.batch = BatchBuffer(n_batch)
        self.pieces = [f" w{i}".encode() for i in range(NUM_PIECES)]
        self.num_decodes = 0
        self._seed: list[int] = []

    def decode(self, chunks: list[Chunk]) -> tuple[int, list[int]]:
        """Fill the batch as LlamaModel does, decode nothing."""
        _, logit_idx = self.batch.fill(chunks)
        self.num_decodes += 1
        self._seed = [c.start_pos + len(c.tokens) for c in chunks]
        return DECODE_OK, logit_idx

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Nothing to share: there are no cells."""

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        """Nothing to free: there are no cells."""

    def kv_share_blocker(self) -> str | None:
        """Prefix sharing is allowed (the scheduler's cache bookkeeping runs as in production)."""
        return None

    def make_sampler(self, params: SamplingParams, prompt_tokens: list[int]):
        """No sampler state: LlamaModel's plain greedy also has none."""
        return None

    def sample(self, sampler, params: SamplingParams, batch_index: int) -> int:
        """A token in 10..(10 + NUM_PIECES), from the batch position: deterministic, never EOS."""
        return 10 + (batch_index * 31 + self.num_decodes) % NUM_PIECES

    def free_sampler(self, sampler) -> None:
        """Nothing to free."""

    def logprob(self, batch_index: int, token: int, top_n: int) -> dict:
        """Not asked for by this bench."""
        raise NotImplementedError("the overhead bench asks for no logprobs")

    def token_bytes(self, token: int) -> bytes:
        """The token's piece."""
        return self.pieces[(token - 10) % NUM_PIECES]

    def is_eog(self, token: int) -> bool:
        """Never the end: every request runs to max_tokens."""
        return False


@dataclass
class LevelRun:
    """One run at one level: steady-state iterations (every sequence decoding) and their timings."""

    level: int
    instrumented: bool
    iterations: int
    span_s: float
    iterations_per_s: float
    iteration_us_mean: float
    iteration_us_p50: float
    iteration_us_p95: float
    per_seq_us: float
    phases_us: dict[str, float] | None = None  # per iteration, mean over the steady state


class _PhaseTimer:
    """Wraps the engine's phase functions with perf_counter timers (instance attributes only)."""

    def __init__(self, engine: Engine):
        self.totals = dict.fromkeys(PHASES[:-1], 0.0)
        self.marks: list[dict[str, float]] = []
        sched = engine.scheduler
        self._wrap(sched, "schedule", "scheduling")
        self._wrap(sched, "commit", "scheduling")
        self._wrap(engine.model, "decode", "batch_filling")
        self._wrap(engine.model, "sample", "sampling")
        # _sample_one holds sampling and streaming: streaming is its time less the sample call's.
        inner = engine._sample_one
        totals = self.totals
        clock = time.perf_counter

        def sample_one(*args, **kwargs):
            t = clock()
            before = totals["sampling"]
            try:
                return inner(*args, **kwargs)
            finally:
                totals["streaming"] += clock() - t - (totals["sampling"] - before)

        engine._sample_one = sample_one

    def _wrap(self, obj, name: str, phase: str) -> None:
        inner = getattr(obj, name)
        totals = self.totals
        clock = time.perf_counter

        def timed(*args, **kwargs):
            t = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[phase] += clock() - t

        setattr(obj, name, timed)

    def mark(self) -> None:
        """Record the running totals (once per finished iteration)."""
        self.marks.append(dict(self.totals))


def run_level(level: int, gen_tokens: int = GEN_TOKENS, instrumented: bool = False,
              timeout_s: float = 300.0) -> LevelRun:
    """Drive a fresh engine on an InstantModel with `level` requests decoding together."""
    n_ctx = level * (PROMPT_TOKENS + gen_tokens) + 64
    model = InstantModel(n_seq_max=level, n_ctx=n_ctx)
    engine = Engine(model, max_waiting=max(64, level), iteration_history=gen_tokens + 64)
    timer = _PhaseTimer(engine) if instrumented else None
    if timer is not None:
        # The iteration's stats are appended last in _iterate: one mark per iteration, aligned with them.
        engine.iterations = _MarkingDeque(engine.iterations, timer)
    done = threading.Semaphore(0)
    engine.finished_listeners.append(lambda stats: done.release())
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    # Distinct prompts (no shared prefix), all submitted before the engine starts: one admission.
    handles = [engine.submit([1000 + level * i + j for j in range(PROMPT_TOKENS)], params) for i in range(level)]
    engine.start()
    try:
        for _ in handles:
            if not done.acquire(timeout=timeout_s):
                raise RuntimeError(f"the instant engine did not finish {level} requests within {timeout_s} s")
        for h in handles:
            last = None
            for ev in engine.events(h, poll_s=1.0):
                last = ev
                if isinstance(ev, Finished):
                    break
            if not isinstance(last, Finished) or last.finish_reason != "length" or \
                    last.stats.num_completion_tokens != gen_tokens:
                raise RuntimeError(f"request {h.request_id} did not run to {gen_tokens} tokens: {last}")
        iters = list(engine.iterations)
    finally:
        engine.stop()
    steady = [i for i, it in enumerate(iters)
              if it.num_prompt_tokens == 0 and it.num_decode_tokens == level and it.num_seqs == level]
    if len(steady) < 2:
        raise RuntimeError(f"only {len(steady)} steady iterations at level {level}")
    first, last = iters[steady[0]], iters[steady[-1]]
    # From the start of the first steady iteration to the start of the last: n-1 full cycles,
    # the engine loop's own work between iterations included.
    span_s = last.start_s - first.start_s
    cycles = len(steady) - 1
    times_us = [iters[i].iteration_ms * 1000 for i in steady]
    run = LevelRun(
        level=level, instrumented=instrumented, iterations=len(steady), span_s=span_s,
        iterations_per_s=cycles / span_s if span_s > 0 else float("inf"),
        iteration_us_mean=statistics.fmean(times_us), iteration_us_p50=median(times_us),
        iteration_us_p95=quantile(times_us, 0.95), per_seq_us=span_s / cycles / level * 1e6,
    )
    if timer is not None:
        marks = timer.marks
        a, b = marks[steady[0] - 1] if steady[0] > 0 else dict.fromkeys(PHASES[:-1], 0.0), marks[steady[-1]]
        n = len(steady)
        phases = {p: (b[p] - a[p]) / n * 1e6 for p in PHASES[:-1]}
        total_us = sum(times_us) / n
        phases["other"] = max(0.0, total_us - sum(phases.values()))
        run.phases_us = phases
    return run


class _MarkingDeque:
    """The engine's iteration deque, marking the phase timers as each iteration's stats arrive."""

    def __init__(self, inner, timer: _PhaseTimer):
        self._inner = inner
        self._timer = timer

    def append(self, item) -> None:
        """Store the stats and mark the timers."""
        self._timer.mark()
        self._inner.append(item)

    def __iter__(self):
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)

    def __getitem__(self, i):
        return self._inner[i]


def run_levels(levels=LEVELS, repeats: int = 3, gen_tokens: int = GEN_TOKENS, out=sys.stderr) -> dict:
    """Plain and instrumented runs per level, interleaved; medians with the repetitions kept."""
    result: dict = {}
    for level in levels:
        plain, timed = [], []
        for _ in range(repeats):
            plain.append(run_level(level, gen_tokens))
            timed.append(run_level(level, gen_tokens, instrumented=True))
        best = sorted(plain, key=lambda r: r.iterations_per_s)[len(plain) // 2]
        phases = {p: median([r.phases_us[p] for r in timed]) for p in PHASES}
        result[str(level)] = {
            "iterations_per_s": best.iterations_per_s,
            "iteration_us": best.span_s / (best.iterations - 1) * 1e6,
            "iteration_us_p95": best.iteration_us_p95,
            "per_seq_us": best.per_seq_us,
            "phases_us_per_iteration": phases,
            "phases_us_per_seq": {p: v / level for p, v in phases.items()},
            "iterations_per_s_all": [r.iterations_per_s for r in plain],
            "runs": [asdict(r) for r in plain + timed],
        }
        print(f"  L={level}: {best.iterations_per_s:,.0f} it/s, {best.per_seq_us:.1f} us/seq", file=out, flush=True)
    return result


def sample_costs(model_path: str, threads: int, num_seqs: int = 8, reps: int = 30) -> dict:
    """Microseconds per sample call on real logits (the model's own vocabulary), per sampling kind."""
    from app.engine.grammar import json_object_grammar
    from app.engine.llama_model import LlamaModel
    from app.engine.model_config import ModelConfig
    from app.engine.request import Request

    model = LlamaModel(ModelConfig(path=model_path, n_ctx=1024, n_seq_max=num_seqs, n_batch=512,
                                   n_threads=threads))
    try:
        prompts = [model.tokenize(f"Item {i}: the household's shared server answers") for i in range(num_seqs)]
        chunks = []
        for slot, p in enumerate(prompts):
            r = Request(prompt_tokens=p)
            r.slot = slot
            chunks.append(Chunk(r, p, 0, True))
        rc, idx = model.decode(chunks)
        if rc != DECODE_OK:
            raise RuntimeError(f"llama_decode returned {rc}")
        kinds = {
            "greedy": SamplingParams(temperature=0.0),
            "greedy_ignore_eos": SamplingParams(temperature=0.0, ignore_eos=True),
            "chain": SamplingParams(),
            "chain_penalties": SamplingParams(repeat_penalty=1.1),
            "grammar_json_greedy": SamplingParams(temperature=0.0, grammar=json_object_grammar()),
            "grammar_json_chain": SamplingParams(grammar=json_object_grammar()),
        }
        out: dict = {"n_vocab": model.n_vocab, "model": model.describe()["desc"], "num_seqs": num_seqs}
        for name, params in kinds.items():
            times = []
            for _ in range(reps):
                for slot, p in enumerate(prompts):
                    # A fresh sampler per call: grammars and penalties carry state from token to token.
                    sampler = model.make_sampler(params, p)
                    t = time.perf_counter()
                    model.sample(sampler, params, idx[slot])
                    times.append(time.perf_counter() - t)
                    model.free_sampler(sampler)
            out[name] = {"us_p50": median(times) * 1e6, "us_p95": quantile(times, 0.95) * 1e6}
        return out
    finally:
        model.close()


def run_from_args(args, sample_model: str | None) -> int:
    """`hearth bench overhead`: print the table, write JSON when asked (sample_model None: no real-model part)."""
    constants = {
        "backend": "InstantModel (decode returns at once; batch filled by app.engine.llama_model.BatchBuffer)",
        "levels": args.levels, "prompt_tokens": PROMPT_TOKENS, "gen_tokens": args.gen_tokens,
        "repeats": args.repeats, "sampling": "greedy, ignore_eos (fixed lengths)", "mode": "continuous",
        "prefix_cache": True, "machine": machine(),
    }
    print("hearth bench overhead — held constant:", file=sys.stderr)
    for k, v in constants.items():
        print(f"  {k}: {v}", file=sys.stderr)
    levels = run_levels(args.levels, args.repeats, args.gen_tokens)
    head = f"{'L':>3}{'it/s':>9}{'us/it':>8}{'us/seq':>8}" + "".join(f"{p[:10]:>11}" for p in PHASES)
    print("\nengine overhead, instant backend (phases: us per iteration)")
    print(head)
    print("-" * len(head))
    for level, r in levels.items():
        ph = r["phases_us_per_iteration"]
        print(f"{level:>3}{r['iterations_per_s']:>9,.0f}{r['iteration_us']:>8.0f}{r['per_seq_us']:>8.1f}"
              + "".join(f"{ph[p]:>11.1f}" for p in PHASES))
    sampling = None
    if sample_model is not None:
        sampling = sample_costs(sample_model, args.threads)
        print(f"\nsampling on real logits ({sampling['model']}, vocabulary {sampling['n_vocab']:,}): us per sequence")
        for name, v in sampling.items():
            if isinstance(v, dict):
                print(f"  {name:<22}{v['us_p50']:>9.1f} p50 {v['us_p95']:>9.1f} p95")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"constants": constants, "levels": levels, "sampling": sampling},
                                                   indent=1))
        print(f"wrote {args.json_path}", file=sys.stderr)
    return 0
