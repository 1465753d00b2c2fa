"""`hearth bench spec`: speculation per --spec-type, hearth runner against stock llama-server with the same type.

Prompts (raw completions): `code`, a stream copying code (twelve short Python handlers, then "The same code with
`event` renamed to `payload`:"), where drafts from the context are mostly kept; `prose`, the start of a story,
greedy (Gemma 270M falls into a loop on it under greedy decoding, so drafts are kept there too); and `free`, the same
story sampled (temperature 1, top-k 64, top-p 0.95, a fixed seed), where the text does not repeat and most drafts
fail, so the cost rule's cost side shows. One runner at a time, started afresh per arm and prompt
with the same model, context, slots and threads; per start a short warm-up, then the request sent `--best-of`
times, the best rate taken; `--rounds` rounds with the arms interleaved, the median of those. Per arm: generated
tok/s as the client times it (first to last streamed token), the runner's own draft counts (timings.draft_n /
draft_n_accepted), and whether the text equals llama-server's with the same type and Hearth's without drafts.
Hearth's by-cost default is `auto`, which is ngram-lookup without a draft model (app.residency.runner_spec). A lab
figure of one runner driven directly: `hearth bench replay` measures the household's scenarios through `hearth serve`.
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

from app.devtools.processes import stop_process, wait_healthy
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
# The issue-52 workload: twelve short handlers of an `event`, then the rename the model copies them through.
HANDLERS = "\n\n".join(f"""def on_{name}(event):
    \"\"\"{doc}\"\"\"
    if event.get("{key}") is None:
        return None
    log.info("{name}: %s", event["{key}"])
    return {{"kind": "{name}", "value": event["{key}"], "room": event.get("room", "hall")}}""" for name, key, doc in (
    ("doorbell", "pressed", "Someone rang the front door."), ("motion", "zone", "The hall sensor saw movement."),
    ("thermostat", "target", "The heating target changed."), ("washer", "cycle", "The washing machine finished."),
    ("garage", "state", "The garage door moved."), ("leak", "sensor", "Water under the sink."),
    ("light", "level", "A lamp was dimmed."), ("window", "open", "A window was opened."),
    ("smoke", "alarm", "The smoke alarm went off."), ("plant", "moisture", "The basil is thirsty."),
    ("mail", "count", "Post arrived."), ("vacuum", "battery", "The robot vacuum is low on battery.")))
CODE_PROMPT = HANDLERS + "\n\n\nThe same code with `event` renamed to `payload`:\n\n"
PROSE_PROMPT = ("The following is an original short story, never published before.\n\n"
                "The Lighthouse at Corran Point\n\nMaren had kept the light for eleven winters when the letter "
                "came, folded twice and smelling faintly of tar. She read it standing in the doorway, the wind "
                "pulling at the paper, and then she read it again by the stove. ")
PROMPTS = {"code": CODE_PROMPT, "prose": PROSE_PROMPT, "free": PROSE_PROMPT}
# Sampling per prompt (greedy where absent): `free` is sampled so that the text does not repeat.
SAMPLING = {"free": {"temperature": 1.0, "top_k": 64, "top_p": 0.95, "min_p": 0.0, "seed": 7}}
# The old single prompt (a function list copied unchanged), kept for --prompts functions.
PROMPTS["functions"] = CODE + "\n\n# The same functions again, unchanged:\n\n" + CODE.splitlines()[0] + "\n"
PROMPT = PROMPTS["functions"]  # the runner tests' copying prompt
SHARED_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "draft-simple")
HEARTH_ARMS = ("none", "ngram-lookup", *SHARED_TYPES)
LLAMA_ARMS = ("none", *SHARED_TYPES)


@dataclass
class Arm:
    """One server configuration and what it measured."""

    name: str
    command: list[str]
    prompt: str = "code"
    rates: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    texts: list[str] = field(default_factory=list)
    tokens: int = 0
    # A hearth runner's cost rule at the end of its last start: per draft source, decisions and the last one's why.
    rule: dict = field(default_factory=dict)


def _one(url: str, max_tokens: int, prompt: str) -> tuple[float, str, int, dict]:
    """One streamed raw completion of a named prompt: (tok/s first→last token, text, tokens, final timings)."""
    body = {"prompt": PROMPTS[prompt], "n_predict": max_tokens, "temperature": 0, "stream": True,
            "cache_prompt": False, "ignore_eos": True, **SAMPLING.get(prompt, {})}
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


def arms_for(model: str, threads: int, ctx: int, parallel: int, llama_server: str | None, prompts=("code",),
             hearth_arms=HEARTH_ARMS, llama_arms=LLAMA_ARMS, hearth_extra: tuple[str, ...] = (),
             draft_model: str | None = None) -> list[Arm]:
    """One arm per server kind × --spec-type × prompt; draft-simple arms get `-md draft_model` and are left out
    without one."""
    common = ["-m", model, "-c", str(ctx), "-np", str(parallel), "-t", str(threads)]

    def md(t: str) -> list[str]:
        return ["-md", draft_model] if t == "draft-simple" else []

    def usable(t: str) -> bool:
        return t != "draft-simple" or bool(draft_model)
    arms = []
    for prompt in prompts:
        arms += [Arm(f"hearth {t}", [sys.executable, "-m", "app.cli", "runner", *common, "--spec-type", t, *md(t),
                                     *hearth_extra], prompt) for t in hearth_arms if usable(t)]
        if llama_server:
            # The same cache layout as a hearth runner (stock_server.SAME_CACHE): without it llama-server's logits
            # differ beyond a near-tie (the prose prompt's first token: logprob -0.305 against -0.241) and the greedy
            # texts part after four tokens.
            arms += [Arm(f"llama-server {t}", stock_command(llama_server, None, *common, "--spec-type", t, *md(t),
                                                            "--no-webui"), prompt)
                     for t in llama_arms if usable(t)]
    return arms


def measure(arm: Arm, max_tokens: int, best_of: int) -> tuple[float, str, int, dict]:
    """Start the arm's server, warm it up, send its prompt best_of times; the best (rate, text, tokens, timings)."""
    port = free_port()
    proc = subprocess.Popen([*arm.command, "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, lambda: None if proc.poll() is None else f"code {proc.returncode}", 120, arm.name,
                     interval_s=0.2)
        _one(url, 16, arm.prompt)  # warm-up: page cache, threads
        best = max((_one(url, max_tokens, arm.prompt) for _ in range(max(best_of, 1))),
                   key=lambda one: one[0])
        if arm.name.startswith("hearth "):
            spec = httpx.get(f"{url}/props", timeout=10).json().get("speculative") or {}
            arm.rule = {name: {"decisions": src["decisions"], "last": (src.get("last") or {}).get("why")}
                        for name, src in (spec.get("sources") or {}).items()}
        return best
    finally:
        stop_process(proc)


def run(arms: list[Arm], max_tokens: int, rounds: int, best_of: int = 2) -> list[Arm]:
    """Every arm, `rounds` times, interleaved (reversed every other round); returns the arms with their figures."""
    for rnd in range(rounds):
        for arm in (arms if rnd % 2 == 0 else list(reversed(arms))):
            rate, text, n, timings = measure(arm, max_tokens, best_of)
            arm.rates.append(rate)
            arm.texts.append(text)
            arm.tokens = n
            arm.drafted += int(timings.get("draft_n", 0))
            arm.accepted += int(timings.get("draft_n_accepted", 0))
            print(f"  round {rnd + 1} {arm.prompt} {arm.name}: {rate:.1f} tok/s "
                  f"({timings.get('draft_n_accepted', 0)}/{timings.get('draft_n', 0)} drafted kept)",
                  file=sys.stderr, flush=True)
    return arms


def _type(arm: Arm) -> str:
    return arm.name.split(" ", 1)[1]


def report(arms: list[Arm]) -> str:
    """Per prompt, one row per --spec-type: Hearth's and llama-server's median tok/s, their ratio, Hearth's ratio to
    its own no-draft arm, draft tokens kept / verified, and whether the texts are identical."""
    lines = []
    for prompt in dict.fromkeys(a.prompt for a in arms):
        mine = [a for a in arms if a.prompt == prompt]
        hearth = {_type(a): a for a in mine if a.name.startswith("hearth ")}
        llama = {_type(a): a for a in mine if a.name.startswith("llama-server ")}
        off = hearth.get("none")
        lines += [f"prompt {prompt}:",
                  f"  {'--spec-type':<36} {'hearth':>7} {'llama-srv':>9} {'h/l':>5} {'h/h-off':>7} "
                  f"{'hearth kept/drafted':>19} {'llama kept/drafted':>18} {'= llama':>7} {'= h-off':>7}"]
        for t in dict.fromkeys([*hearth, *llama]):
            h, ll = hearth.get(t), llama.get(t)
            hm = statistics.median(h.rates) if h else None
            lm = statistics.median(ll.rates) if ll else None
            label = t + (" (auto, by cost)" if t == "ngram-lookup" else "")

            def fig(v, spec):
                return format(v, spec) if v is not None else "-"

            def same(a, b):
                return "-" if a is None or b is None else ("yes" if a.texts == b.texts else "NO")

            def counts(a):
                return "-" if a is None else f"{a.accepted}/{a.drafted}"
            lines.append(f"  {label:<36} {fig(hm, '7.1f'):>7} {fig(lm, '9.1f'):>9} "
                         f"{fig(hm / lm if hm and lm else None, '5.2f'):>5} "
                         f"{fig(hm / statistics.median(off.rates) if hm and off and off.rates[0] else None, '7.2f'):>7} "
                         f"{counts(h):>19} {counts(ll):>18} {same(h, ll):>7} {same(h, off):>7}")
    return "\n".join(lines)


def main(args) -> int:
    """Entry point of `hearth bench spec`."""
    from app.hardware import cpu_model
    from app.paths import data_dir
    from app.residency.default_model import ensure_default_model

    model = args.model or str(ensure_default_model(data_dir(), progress=True))
    server = args.llama_server
    if server and not Path(server).is_file():
        raise SystemExit(f"hearth bench spec: no llama-server at {server} (scripts/build_llama_tools.sh builds it)")
    prompts = tuple(args.prompts.split(","))
    if unknown := [p for p in prompts if p not in PROMPTS]:
        raise SystemExit(f"hearth bench spec: unknown prompt {unknown[0]!r}; one of {', '.join(PROMPTS)}")
    arms = arms_for(model, args.threads, args.ctx, args.parallel, server, prompts,
                    hearth_arms=tuple(args.hearth_types.split(",")), llama_arms=tuple(args.llama_types.split(",")),
                    hearth_extra=tuple(args.hearth_args.split()), draft_model=args.draft_model)
    run(arms, args.max_tokens, args.rounds, args.best_of)
    print(f"raw completions, greedy (free: sampled, {SAMPLING['free']}), {args.max_tokens} tokens, best of "
          f"{args.best_of} per start, median of {args.rounds} rounds; ctx {args.ctx}, {args.parallel} slots, "
          f"{args.threads} threads; model {model}; "
          f"CPU {cpu_model()} (lab figure: runners driven directly)")
    if not args.draft_model:
        print("draft-simple: left out (no --draft-model; `hearth models truncate` writes one)")
    print(report(arms))
    print("the cost rule per hearth arm and source (decisions over warm-up and requests; the last one's reason):")
    for a in arms:
        for name, src in a.rule.items():
            print(f"  {a.prompt} {a.name} {name}: {src['decisions']}; {src['last']}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps([a.__dict__ for a in arms], indent=1))
    return 0
