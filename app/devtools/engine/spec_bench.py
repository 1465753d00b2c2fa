"""`hearth bench spec`: one stream of repetitive work, speculation off and on, beside stock llama-server's n-gram types.

One runner at a time (the same model, context, slots and threads), one raw completion that makes a greedy model
copy a function list, `--rounds` rounds with the arms interleaved. Per arm: generated tok/s as the client times it
(first to last streamed token), the runner's own draft counts (timings.draft_n / draft_n_accepted), and whether the
text equals the first arm's (greedy: it must). A lab figure of one runner driven directly: `hearth bench replay`
measures the household's scenarios through `hearth serve`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from app.devtools.processes import stop_process
from app.devtools.stock_server import stock_command
from app.protocols import sse
from app.residency.supervisor import free_port

CODE = '''def parse_duration(text):
    """Seconds in a duration like '1h30m' or '45s'."""
    units = {"h": 3600, "m": 60, "s": 1}
    total, number = 0, ""
    for ch in text.strip():
        if ch.isdigit():
            number += ch
        elif ch in units and number:
            total += int(number) * units[ch]
            number = ""
        else:
            raise ValueError(f"bad duration: {text!r}")
    return total


def shopping_list(items, pantry):
    """The items not already in the pantry, in the order given."""
    have = {p.lower() for p in pantry}
    return [item for item in items if item.lower() not in have]


def chore_rota(people, chores, week):
    """Who does which chore in a given week: the rota turns by one each week."""
    shift = week % len(people)
    order = people[shift:] + people[:shift]
    return {chore: order[i % len(order)] for i, chore in enumerate(chores)}


def average_temperature(readings):
    """The mean of the readings that are numbers, or None when there are none."""
    values = [r for r in readings if isinstance(r, (int, float))]
    if not values:
        return None
    return sum(values) / len(values)


def bedtime(age):
    """A child's bedtime by age, as the family agreed."""
    if age < 6:
        return "19:00"
    if age < 10:
        return "20:00"
    if age < 14:
        return "21:00"
    return "22:00"
'''
PROMPT = CODE + "\n\n# The same functions again, unchanged:\n\n" + CODE.splitlines()[0] + "\n"
HEARTH_ARMS = ("none", "ngram-lookup")
LLAMA_ARMS = ("none", "ngram-simple", "ngram-map-k", "ngram-mod")


@dataclass
class Arm:
    """One server configuration and what it measured."""

    name: str
    command: list[str]
    rates: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    texts: list[str] = field(default_factory=list)
    tokens: int = 0


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become ready")


def _one(url: str, max_tokens: int) -> tuple[float, str, int, dict]:
    """One streamed raw completion: (tok/s first→last token, text, tokens, final timings)."""
    body = {"prompt": PROMPT, "n_predict": max_tokens, "temperature": 0, "stream": True, "cache_prompt": False,
            "ignore_eos": True}
    times: list[float] = []
    text, timings = [], {}
    with httpx.stream("POST", f"{url}/completion", json=body, timeout=600) as r:
        r.raise_for_status()
        for ev in sse.payloads(r.iter_bytes()):
            if ev.get("content"):
                times.append(time.perf_counter())
                text.append(ev["content"])
            if ev.get("stop"):
                timings = ev.get("timings") or {}
    n = timings.get("predicted_n") or len(times)
    rate = (n - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0
    return rate, "".join(text), n, timings


def run(model: str, threads: int, ctx: int, parallel: int, max_tokens: int, rounds: int,
        llama_server: str | None, hearth_arms=HEARTH_ARMS, llama_arms=LLAMA_ARMS,
        hearth_extra: tuple[str, ...] = (), draft_model: str | None = None) -> list[Arm]:
    """Every arm, `rounds` times, interleaved; returns the arms with their figures. draft-simple arms get
    `-md draft_model`."""
    common = ["-m", model, "-c", str(ctx), "-np", str(parallel), "-t", str(threads)]

    def md(t: str) -> list[str]:
        if t != "draft-simple":
            return []
        if not draft_model:
            raise SystemExit("hearth bench spec: a draft-simple arm needs --draft-model")
        return ["-md", draft_model]
    arms = [Arm(f"hearth {t}", [sys.executable, "-m", "app.cli", "runner", *common, "--spec-type", t, *md(t),
                    *hearth_extra]) for t in hearth_arms]
    if llama_server:
        arms += [Arm(f"llama-server {t}", stock_command(llama_server, None, *common, "--spec-type", t, *md(t),
                                                        "--no-webui", same_cache=False))
                 for t in llama_arms]
    for rnd in range(rounds):
        for arm in (arms if rnd % 2 == 0 else list(reversed(arms))):
            port = free_port()
            proc = subprocess.Popen([*arm.command, "--port", str(port)], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            url = f"http://127.0.0.1:{port}"
            try:
                _wait_ready(url, proc)
                _one(url, 16)  # warm-up: page cache, threads
                rate, text, n, timings = _one(url, max_tokens)
            finally:
                stop_process(proc)
            arm.rates.append(rate)
            arm.texts.append(text)
            arm.tokens = n
            arm.drafted += int(timings.get("draft_n", 0))
            arm.accepted += int(timings.get("draft_n_accepted", 0))
            print(f"  round {rnd + 1} {arm.name}: {rate:.1f} tok/s", file=sys.stderr, flush=True)
    return arms


def report(arms: list[Arm]) -> str:
    """The table: median tok/s, ratio to the first (Hearth off) arm, acceptance, identical output."""
    base = statistics.median(arms[0].rates)
    ref = arms[0].texts[0]
    # Verifying drafts computes a token's logits in a batch of several, where kernels sum in another order: at a
    # near-tie greedy may pick another token. Stock llama-server's drafting arms are the oracle for that.
    oracle = next((a.texts[0] for a in arms if a.name.startswith("llama-server") and a.drafted), None)
    lines = [f"{'arm':<26} {'tok/s':>7} {'× hearth off':>12} {'drafted':>8} {'accepted':>9} {'= off':>6} "
             f"{'= llama-server drafting':>23}"]
    for a in arms:
        med = statistics.median(a.rates)
        acc = f"{a.accepted / a.drafted:.0%}" if a.drafted else "-"
        same = "yes" if all(t == ref for t in a.texts) else "NO"
        like = "-" if oracle is None else ("yes" if all(t == oracle for t in a.texts) else "NO")
        lines.append(f"{a.name:<26} {med:7.1f} {med / base:12.2f} {a.drafted:8d} {acc:>9} {same:>6} {like:>23}")
    return "\n".join(lines)


def main(args) -> int:
    """Entry point of `hearth bench spec`."""
    from app.paths import data_dir
    from app.residency.default_model import ensure_default_model

    model = args.model or str(ensure_default_model(data_dir(), progress=True))
    server = args.llama_server
    if server and not Path(server).is_file():
        raise SystemExit(f"hearth bench spec: no llama-server at {server} (scripts/build_llama_tools.sh builds it)")
    arms = run(model, args.threads, args.ctx, args.parallel, args.max_tokens, args.rounds, server,
               hearth_arms=tuple(args.hearth_types.split(",")), llama_arms=tuple(args.llama_types.split(",")),
               hearth_extra=tuple(args.hearth_args.split()), draft_model=args.draft_model)
    print(f"one stream copying a function list: raw completion, greedy, {args.max_tokens} tokens, "
          f"ctx {args.ctx}, {args.parallel} slots, {args.threads} threads, median of {args.rounds} (lab figure: "
          "runners driven directly)")
    print(report(arms))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps([a.__dict__ for a in arms], indent=1))
    return 0
