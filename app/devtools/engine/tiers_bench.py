"""`hearth bench tiers`: a voice satellite's next turn after its cached system prompt left the KV cache.

A ~2,000-token stable system prompt (a Home Assistant-like device list), hearth runners driven directly on
loopback (a lab figure), `--reps` repetitions, each on a fresh disk folder, the arms in one run:

- full prefill: the first turn on a cold runner (nothing cached anywhere);
- KV hit: the next turn on the same runner (the prefix still in the KV cache);
- RAM tier: a long unrelated prompt evicts the prefix (saved to RAM), then the next turn restores it;
- disk tier: the runner is restarted (SIGTERM: it writes its prefixes), and the next turn reads them back;
- optionally stock llama-server after its own restart (its --cache-ram lives and dies with the process).

`--reload` instead: the model's reload with its weights warm in the page cache vs cold (dropped before the load).

TTFT is the client's: request sent → first streamed token with text. The reload time (process start → /health
ok) is printed beside the disk arm, since the issue's target is TTFT ≤ reload + 0.1 × a full prefill.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from app.devtools.processes import stop_process
from app.devtools.stock_server import stock_command
from app.hardware import machine
from app.protocols import sse
from app.residency.supervisor import free_port

ROOMS = ("kitchen", "hall", "living room", "bedroom", "kids' room", "bathroom", "garage", "office", "garden", "attic")
KINDS = ("ceiling light", "floor lamp", "smart plug", "fan", "blind", "thermostat", "speaker", "sensor")
DEVICES = "".join(
    f"- {room} {kind} {i}: state {'on' if i % 3 else 'off'}, brightness {10 * (i % 10)} %, area {room}\n"
    for i, (room, kind) in enumerate(([(r, k) for r in ROOMS for k in KINDS] * 2)[:100])
)  # ~2,000 tokens with the lines below (Gemma's tokenizer), as a Home Assistant voice prompt with ~100 entities
SYSTEM = ("You are the voice assistant of a family home. Answer in one short sentence. Use the devices below "
          "when asked to control something. These are the devices of the house and their state:\n" + DEVICES)
QUESTIONS = ("Turn on the kitchen ceiling light.", "Is the garage fan on?", "Close the bedroom blind.",
             "What is the office thermostat set to?")
OTHER = "A story about the sea, told slowly. " + " ".join(f"Wave {i} rolls in and out again." for i in range(260))


class Server:
    """One runner process on loopback."""

    def __init__(self, command: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([*command, "--port", str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not become ready")
            time.sleep(0.05)
        self.ready_s = time.perf_counter() - t0

    def ask(self, prompt: str, n_predict: int = 8) -> dict:
        """One streamed greedy completion: TTFT, cached tokens, prompt tokens computed, the text."""
        body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "stream": True, "cache_prompt": True}
        t0 = time.perf_counter()
        ttft, text, timings = None, [], {}
        with httpx.stream("POST", f"{self.url}/completion", json=body, timeout=600) as r:
            r.raise_for_status()
            for ev in sse.payloads(r.iter_bytes()):
                if ev.get("content"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(ev["content"])
                if ev.get("stop"):
                    timings = ev.get("timings") or {}
        return {"ttft_s": ttft, "cache_n": timings.get("cache_n"), "prompt_n": timings.get("prompt_n"),
                "text": "".join(text)}

    def tokens(self, text: str) -> int:
        """Tokens of a prompt as the server counts them."""
        return len(httpx.post(f"{self.url}/tokenize", json={"content": text}, timeout=30).json()["tokens"])

    def stop(self) -> None:
        """SIGTERM and wait (a hearth runner writes its disk tier on the way out)."""
        stop_process(self.proc)


def turn(question: str) -> str:
    """The satellite's prompt for one turn."""
    return f"{SYSTEM}\nUser: {question}\nAssistant:"


def stock_restart(command: list[str]) -> tuple[dict, dict]:
    """Stock llama-server's first turn, and its next turn after a restart (its --cache-ram dies with the process);
    each with the process's reload time (start → /health ok)."""
    turns = []
    for question in (QUESTIONS[0], QUESTIONS[3]):
        s = Server(command)
        try:
            turns.append({**s.ask(turn(question)), "reload_s": s.ready_s})
        finally:
            s.stop()
    return turns[0], turns[1]


def one_rep(hearth: list[str], llama_server: list[str] | None, rep: int) -> dict[str, dict]:
    """Every arm once; a fresh disk folder, so nothing from an earlier repetition is found."""
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="hearth-tiers-") as disk:
        tiered = [*hearth, "--cache-disk", disk]
        r = Server(tiered)
        try:
            out["full prefill"] = r.ask(turn(QUESTIONS[0]))
            out["KV hit"] = r.ask(turn(QUESTIONS[1]))
            r.ask(OTHER, n_predict=2)  # needs the cells the system prompt holds: evicted to the RAM tier
            out["RAM tier (evicted)"] = r.ask(turn(QUESTIONS[2]))
        finally:
            r.stop()
        r = Server(tiered)
        try:
            out["disk tier (restarted)"] = {**r.ask(turn(QUESTIONS[3])), "reload_s": r.ready_s}
        finally:
            r.stop()
    if llama_server:
        out["llama-server (restarted)"] = stock_restart(llama_server)[1]
    for name, fig in out.items():
        print(f"  rep {rep + 1} {name}: TTFT {fig['ttft_s']:.3f} s, cached {fig['cache_n']}, "
              f"computed {fig['prompt_n']}", file=sys.stderr, flush=True)
    return out


def cost_round(command: list[str], streams: int, n_predict: int) -> float:
    """Generated tok/s of `streams` concurrent raw completions (distinct short prompts, ignore_eos) on a fresh runner."""
    import concurrent.futures

    s = Server(command)
    try:
        s.ask("Warm up.", n_predict=4)

        def one(i: int) -> int:
            body = {"prompt": f"Story {i}: once upon a time in room {i},", "n_predict": n_predict, "temperature": 0,
                    "ignore_eos": True, "cache_prompt": True}
            r = httpx.post(f"{s.url}/completion", json=body, timeout=600)
            r.raise_for_status()
            return r.json()["timings"]["predicted_n"]

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(streams) as pool:
            n = sum(pool.map(one, range(streams)))
        return n / (time.perf_counter() - t0)
    finally:
        s.stop()


def cost(args, hearth: list[str]) -> int:
    """`--cost`: generated tok/s with the tiers off (--cache-ram 0) and on (the default, and a disk folder)."""
    rates: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="hearth-tiers-") as disk:
        arms = {"off": [*hearth, "--cache-ram", "0"], "on": [*hearth, "--cache-disk", disk]}
        for rnd in range(args.reps):
            for name in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
                rates[name].append(cost_round(arms[name], args.parallel, args.cost_tokens))
                print(f"  round {rnd + 1} tiers {name}: {rates[name][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print(f"{args.parallel} concurrent streams × {args.cost_tokens} tokens, ctx {args.ctx}, {args.threads} threads, "
          f"median of {args.reps} interleaved rounds; machine {json.dumps(machine())}")
    print(f"tiers off {off:.1f} tok/s {rates['off']}, on {on:.1f} tok/s {rates['on']}: on/off {on / off:.3f}")
    return 0


def reload_round(command: list[str], path: str, warm: bool) -> dict:
    """One reload of the model at `path`: its pages read in first (warm) or dropped (cold), then the runner
    started, timed by the client (process start → /health ok), its own load_timings read, one short turn asked."""
    from app.residency.pagecache import cached_fraction, drop, read_ahead

    if warm:
        read_ahead(path)
    else:
        drop(path)
    before = cached_fraction(path)
    s = Server(command)
    try:
        loaded = httpx.get(f"{s.url}/health", timeout=10).json().get("load_timings") or {}
        # A short turn: its prefill is where pages the load left unread would be faulted in, not a long prompt's.
        ttft = s.ask(f"User: {QUESTIONS[0]}\nAssistant:", n_predict=4)["ttft_s"]
        first = httpx.get(f"{s.url}/health", timeout=10).json().get("load_timings") or {}
    finally:
        s.stop()
    return {"weights": "warm" if warm else "cold", "cached_before": before, "reload_s": s.ready_s,
            "read_ms": loaded.get("read_ms"), "context_ms": loaded.get("context_ms"),
            "engine_ms": loaded.get("engine_ms"), "load_ms": loaded.get("load_ms"),
            "first_prefill_ms": first.get("first_prefill_ms"), "first_ttft_s": ttft}


def willneed_probe(path: str) -> dict:
    """The warmer's choice measured: WILLNEED alone (the kernel may cap its read-ahead) against WILLNEED and a read."""
    from app.residency.pagecache import cached_fraction, drop, read_ahead

    drop(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        time.sleep(1.0)
        alone = cached_fraction(path) or 0.0
    finally:
        os.close(fd)
    drop(path)
    t0 = time.perf_counter()
    read_ahead(path)
    return {"willneed_1s": alone, "read_through_ms": (time.perf_counter() - t0) * 1000,
            "read_through": cached_fraction(path) or 0.0}


def reload_bench(args, model: str) -> int:
    """`--reload`: the model's reload time with its weights warm (read ahead) vs cold (DONTNEED before the load),
    through the hearth runner, interleaved, median of --reps each."""
    import shutil

    from app.residency.pagecache import drop

    rounds: dict[str, list[dict]] = {"warm": [], "cold": []}
    with tempfile.TemporaryDirectory(prefix="hearth-reload-") as folder:
        # A copy of its own (synced: DONTNEED drops only clean pages), so other runners' pages of the file stay.
        path = str(shutil.copy(model, Path(folder) / Path(model).name))
        drop(path)
        probe = willneed_probe(path)
        command = [sys.executable, "-m", "app.cli", "runner", "-m", path, "-c", str(args.ctx), "-np",
                   str(args.parallel), "-t", str(args.threads), "--cache-ram", "0"]
        for rnd in range(args.reps):
            for name in (("cold", "warm") if rnd % 2 == 0 else ("warm", "cold")):
                fig = reload_round(command, path, warm=name == "warm")
                rounds[name].append(fig)
                print(f"  round {rnd + 1} {name}: in page cache before {100 * (fig['cached_before'] or 0):.0f} %, "
                      f"reload {fig['reload_s']:.2f} s (read {fig['read_ms']:.0f} ms, context {fig['context_ms']:.0f}"
                      f" ms), first prefill {fig['first_prefill_ms']:.0f} ms", file=sys.stderr, flush=True)
    print(f"model {Path(model).name} sha256 {file_sha256(model)[:16]}…, ctx {args.ctx}, {args.parallel} slots, "
          f"{args.threads} threads, CPU only, --cache-ram 0; machine {json.dumps(machine())}")
    print("reload = hearth runner process start → /health ok, by the client; read/context = the runner's own "
          f"load_timings; first prefill of a short {QUESTIONS[0]!r} turn; median of {args.reps} (min–max), interleaved")
    print(f"read-ahead: POSIX_FADV_WILLNEED alone left {100 * probe['willneed_1s']:.0f} % of the file in the page "
          f"cache 1 s later; WILLNEED + reading it through (what the warmer does) {probe['read_through_ms']:.0f} ms "
          f"to {100 * probe['read_through']:.0f} %")
    med = {}
    for name in ("cold", "warm"):
        figs = rounds[name]
        line = []
        for key in ("reload_s", "read_ms", "context_ms", "first_prefill_ms", "first_ttft_s"):
            values = [f[key] for f in figs if f[key] is not None]
            m = statistics.median(values) if values else float("nan")
            med[(name, key)] = m
            line.append(f"{key} {m:.3f} ({min(values, default=m):.3f}–{max(values, default=m):.3f})")
        print(f"{name:<5} " + ", ".join(line))
    print(f"warm/cold reload {med[('warm', 'reload_s')] / med[('cold', 'reload_s')]:.3f}, "
          f"read {med[('warm', 'read_ms')] / med[('cold', 'read_ms')]:.3f}, first prefill "
          f"{med[('warm', 'first_prefill_ms')] / med[('cold', 'first_prefill_ms')]:.3f}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"ctx": args.ctx, "threads": args.threads, "read_ahead": probe,
                                                    "rounds": rounds}, indent=1))
    return 0


def file_sha256(path: str) -> str:
    """The model file's hash, for the header."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_path(args) -> str:
    """--model, else the embedded Gemma 3 270M (assembled on first use)."""
    from app.paths import data_dir
    from app.residency.default_model import ensure_default_model

    return args.model or str(ensure_default_model(data_dir(), progress=True))


def main(args) -> int:
    """Entry point of `hearth bench tiers` (lab arms; --serve is app.devtools.serving.tiers_serve_bench)."""
    model = model_path(args)
    common = ["-m", model, "-c", str(args.ctx), "-np", str(args.parallel), "-t", str(args.threads)]
    hearth = [sys.executable, "-m", "app.cli", "runner", *common]
    if args.cost:
        return cost(args, hearth)
    if getattr(args, "reload", False):
        return reload_bench(args, model)
    stock = None
    if args.llama_server:
        if not Path(args.llama_server).is_file():
            raise SystemExit(f"hearth bench tiers: no llama-server at {args.llama_server}")
        stock = stock_command(args.llama_server, None, *common, "--kv-unified", "--no-webui", same_cache=False)
    probe = Server([*hearth, "--cache-ram", "0"])
    try:
        n_system = probe.tokens(SYSTEM)
        n_other = probe.tokens(OTHER)
    finally:
        probe.stop()
    if n_system + n_other <= args.ctx:
        raise SystemExit(f"hearth bench tiers: --ctx {args.ctx} holds the system prompt ({n_system} tokens) and the "
                         f"evicting prompt ({n_other}) together: nothing would be evicted; use a smaller --ctx")
    reps = [one_rep(hearth, stock, i) for i in range(args.reps)]
    print(f"model {Path(model).name} sha256 {file_sha256(model)[:16]}…, ctx {args.ctx}, {args.parallel} slots, "
          f"{args.threads} threads, n_batch 512, CPU only; system prompt {n_system} tokens; "
          f"machine {json.dumps(machine())}")
    print("lab figure: hearth runners driven directly on loopback; TTFT = request sent → first token with text; "
          f"median of {args.reps} (min–max)")
    full = statistics.median(r["full prefill"]["ttft_s"] for r in reps)
    print(f"{'arm':<26} {'TTFT s':>8} {'min–max':>15} {'× full prefill':>15} {'cached':>7} {'reload s':>9}")
    for name in reps[0]:
        ttfts = [r[name]["ttft_s"] for r in reps]
        med = statistics.median(ttfts)
        reload = [r[name]["reload_s"] for r in reps if "reload_s" in r[name]]
        reload_txt = f"{statistics.median(reload):9.2f}" if reload else ""
        print(f"{name:<26} {med:8.3f} {min(ttfts):7.3f}–{max(ttfts):<7.3f} {med / full:15.3f} "
              f"{reps[-1][name]['cache_n']!s:>7} {reload_txt}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"n_system_tokens": n_system, "ctx": args.ctx,
                                                    "threads": args.threads, "reps": reps}, indent=1))
    return 0
