"""`hearth bench flood`: does `hearth serve`, with default settings, hold a household's worst load?

One run, on a fresh data folder and the embedded model (or --model):

1. quiet box: the gateway's added latency over its own runner (alternating A/B): non-streamed
   p50, p50 to the first generated token (not the role chunk), and N concurrent streams' tok/s
   through the gateway vs direct;
2. long prompt: a streamed request with a prompt of --long-prompt tokens; the TTFT the request
   log stored vs the client's stopwatch;
3. flood: --background streamed background requests sent at once, --half-open connections
   that send half a request and stop, --idle keep-alive connections that stay silent; meanwhile
   /healthz is probed on a fresh connection every --probe-ms and --voice voice requests are sent;
   serve's RSS is sampled;
4. after: threads, descriptors and KV cells used, waited for until they are back at the baseline.

Targets (issue 14): /healthz p99 ≤ 100 ms, voice TTFT ≤ 2 s, RSS ≤ +100 MB, 0 unexpected 5xx,
back to baseline; added latency p50 ≤ 3 ms (whole) / ≤ 5 ms (first token); streams ≥ 0.97× direct;
stored streamed TTFT within 5 % of the client's. The client runs in this process on asyncio
(raw HTTP/1.0, so no chunked framing to undo), one OS thread for all of it.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import re
import sqlite3
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from app.devtools.serve_process import ServeProcess, prepare_data
from app.devtools.serving.gateway_bench import TOKEN_EVENT, _streams, added_latency_samples

MIB = 1024 * 1024
CHAT = "/v1/chat/completions"


def say(line: str) -> None:
    """Print a figure as soon as it is measured (a long run cut short still leaves its figures)."""
    print(line, flush=True)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of values."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs) + 0.5) - 1))]


@dataclass
class Answer:
    """One raw HTTP/1.0 exchange as the client saw it."""

    status: int = 0
    first_token_ms: float | None = None
    total_ms: float = 0.0
    error_event: bool = False
    body: bytes = b""


async def _request(port: int, method: str, path: str, headers: dict, body: bytes = b"",
                   timeout_s: float = 900) -> Answer:
    """Send one request on a fresh connection and read the answer to its end (HTTP/1.0: until close)."""
    t0 = time.perf_counter()
    out = Answer()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = [f"{method} {path} HTTP/1.0", "Host: 127.0.0.1", f"Content-Length: {len(body)}",
                *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await writer.drain()
        buf = b""
        async with asyncio.timeout(timeout_s):
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                buf += data
                if out.first_token_ms is None and b"\r\n\r\n" in buf and TOKEN_EVENT.search(buf.partition(b"\r\n\r\n")[2]):
                    out.first_token_ms = (time.perf_counter() - t0) * 1000
        status_line = buf.split(b"\r\n", 1)[0].split()
        out.status = int(status_line[1]) if len(status_line) > 1 else 0
        out.body = buf.partition(b"\r\n\r\n")[2]
        out.error_event = b'"error"' in out.body and out.status == 200
    finally:
        writer.close()
    out.total_ms = (time.perf_counter() - t0) * 1000
    return out


def _chat(token: str, klass: str, content: str, max_tokens: int, stream: bool = True) -> tuple[dict, bytes]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "stream": stream,
            "temperature": 0}
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json", "X-Hearth-Class": klass}
    return headers, json.dumps(body).encode()


@dataclass
class Census:
    """What serve holds: threads, descriptors, RSS (runners excluded), KV cells in use on its runner."""

    threads: int
    fds: int
    rss: int
    kv_used: float | None

    def line(self) -> str:
        """One line for the report."""
        kv = "n/a" if self.kv_used is None else f"{self.kv_used:.0f}"
        return f"threads {self.threads}, descriptors {self.fds}, RSS {self.rss / MIB:.1f} MiB, KV cells used {kv}"


def census(serve: ServeProcess) -> Census:
    """Count serve's own processes (arbiter and worker), not its runners."""
    runners = {p.pid for p in serve.runner_processes()}
    parent = psutil.Process(serve.proc.pid)
    procs = [parent] + [p for p in parent.children(recursive=True) if p.pid not in runners]
    kv = None
    try:
        text = httpx.get(serve.runner_url() + "/metrics", headers=serve.runner_headers(), timeout=5).text
        match = re.search(r"^hearth:kv_cells_used(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
        kv = float(match.group(1)) if match else None
    except (LookupError, httpx.HTTPError):
        pass
    return Census(sum(p.num_threads() for p in procs), sum(p.num_fds() for p in procs),
                  sum(p.memory_info().rss for p in procs), kv)


@dataclass
class FloodResult:
    """The flood phase's raw evidence."""

    healthz_ms: list[float] = field(default_factory=list)
    healthz_failed: int = 0
    voice: list[Answer] = field(default_factory=list)
    background: list[Answer] = field(default_factory=list)
    rss_peak: int = 0


async def _flood(serve: ServeProcess, token: str, args) -> FloodResult:
    port = serve.port
    res = FloodResult()
    stop = asyncio.Event()

    async def half_open() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        await writer.drain()
        try:
            await asyncio.wait_for(reader.read(), args.duration)  # the server's close, if it comes
        except TimeoutError:
            pass
        writer.close()

    async def idle() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await writer.drain()
        try:
            await asyncio.wait_for(reader.read(), args.duration)  # answer, then the keep-alive close
        except TimeoutError:
            pass
        writer.close()

    async def probe() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                a = await _request(port, "GET", "/healthz", {}, timeout_s=30)
                if a.status == 200:
                    res.healthz_ms.append((time.perf_counter() - t0) * 1000)
                else:
                    res.healthz_failed += 1
            except (OSError, TimeoutError):
                res.healthz_failed += 1
            await asyncio.sleep(args.probe_ms / 1000)

    async def sample_rss() -> None:
        while not stop.is_set():
            res.rss_peak = max(res.rss_peak, serve.serve_rss_bytes())
            await asyncio.sleep(0.5)

    async def voice() -> None:
        await asyncio.sleep(2)  # the background queue is full by then
        for i in range(args.voice):
            headers, body = _chat(token, "voice", f"Say hello {i}.", 8)
            res.voice.append(await _request(port, "POST", CHAT, headers, body))
            await asyncio.sleep(1)

    async def background(i: int) -> Answer:
        headers, body = _chat(token, "background", f"Summarise note {i}: the heating is on.", args.bg_tokens)
        return await _request(port, "POST", CHAT, headers, body)

    side = [asyncio.create_task(c) for c in (probe(), sample_rss())]
    held = [asyncio.create_task(half_open()) for _ in range(args.half_open)]
    held += [asyncio.create_task(idle()) for _ in range(args.idle)]
    bg = [asyncio.create_task(background(i)) for i in range(args.background)]
    await voice()
    for a in await asyncio.gather(*bg, return_exceptions=True):
        # A connection the server dropped counts as a 5xx: the client got no answer.
        res.background.append(a if isinstance(a, Answer) else Answer(status=599, body=repr(a).encode()))
    await asyncio.gather(*held)
    stop.set()
    await asyncio.gather(*side)
    return res


def _long_prompt_ttft(serve: ServeProcess, token: str, prompt_tokens: int) -> tuple[float, float, int]:
    """(client stopwatch, stored ttft_ms, prompt tokens) for one streamed request with a long prompt."""
    # About 9 tokens a sentence with Gemma's tokenizer; the log's prompt_tokens gives the true count.
    prompt = " ".join(f"item{i % 97} is on shelf {i % 13}." for i in range(prompt_tokens // 9))
    headers, body = _chat(token, "chat", prompt + "\nWhich shelf holds item5?", 8)
    answer = asyncio.run(_request(serve.port, "POST", CHAT, headers, body))
    if answer.status != 200 or answer.first_token_ms is None:
        raise RuntimeError(f"long-prompt request failed: {answer.status} {answer.body[:300]!r}")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with sqlite3.connect(serve.data / "hearth.db") as db:
            # Its own row: the writer may not have stored it yet while earlier streams' rows are there.
            row = db.execute("select ttft_ms, prompt_tokens from requests where class_name = 'chat' and stream = 1 "
                             "and prompt_tokens >= ? order by id desc limit 1", (prompt_tokens // 2,)).fetchone()
        if row and row[0] is not None:
            return answer.first_token_ms, row[0], row[1]
        time.sleep(0.2)
    raise RuntimeError("the long-prompt request was not logged")


def run_flood(args, model_path: str) -> int:
    """Run the four phases against a fresh `hearth serve` with default settings; print the figures."""
    with tempfile.TemporaryDirectory(prefix="hearth-flood-") as tmp:
        data, models = Path(tmp) / "data", Path(tmp) / "models"
        models.mkdir()
        # Default settings, except chat's concurrency for the A/B phase: N streams through the gateway must
        # run at once as they do direct (the runner's 4 default slots queue the rest in both paths alike).
        # The model is pinned: during the direct phases serve holds no lease and would unload it as idle.
        # One token stands for the whole household here: it may hold whole classes (member_class_share 1).
        tokens = prepare_data(data, tokens=[("bench", "background", ["voice", "chat"])],
                              settings={"member_class_share": 1.0},
                              classes={"chat": {"max_concurrent": max(8, args.streams), "queue_timeout_s": 600}},
                              policies={Path(model_path).stem: "pinned"})
        token = tokens["bench"]
        serve = ServeProcess(data, models, Path(model_path), Path(tmp) / "serve.log")
        try:
            gw_headers = {"Authorization": f"Bearer {token}", "X-Hearth-Class": "chat"}
            client = httpx.Client(timeout=600)
            lat, ttft = added_latency_samples(client, serve, gw_headers, args.samples)
            gw, direct = serve.url + "/v1/completions", serve.runner_url() + "/v1/completions"
            med = {k: statistics.median(v) for k, v in lat.items()}
            med_t = {k: statistics.median(v) for k, v in ttft.items()}
            cpu = platform.processor() or platform.machine()
            props = httpx.get(serve.runner_url() + "/props", headers=serve.runner_headers(), timeout=10).json()
            say(f"model {model_path}; hearth serve with default settings (runner sized by serve: "
                f"{props.get('total_slots')} slots, {props.get('default_generation_settings', {}).get('n_ctx')} "
                f"KV cells shared, threads = cores; model pinned, chat {max(8, args.streams)} concurrent); "
                f"machine: {cpu}, {os.cpu_count()} "
                f"cores, load average {os.getloadavg()[0]:.1f}")
            say(f"-- quiet box, {args.samples} alternating samples:")
            say(f"   non-streamed (1 token): direct p50 {med['direct']:.2f} ms, gateway {med['gateway']:.2f} ms "
                f"→ added {med['gateway'] - med['direct']:.2f} ms (target ≤ 3)")
            say(f"   to first token:         direct p50 {med_t['direct']:.2f} ms, gateway {med_t['gateway']:.2f} ms "
                f"→ added {med_t['gateway'] - med_t['direct']:.2f} ms (target ≤ 5)")
            rates = {"direct": [], "gateway": []}
            for _ in range(args.repeats):
                rates["direct"].append(_streams(direct, {}, args.streams, args.tokens))
                rates["gateway"].append(_streams(gw, gw_headers, args.streams, args.tokens))
            ratios = [g / d for g, d in zip(rates["gateway"], rates["direct"]) if d]
            if ratios:
                say(f"   {args.streams} concurrent streams × {args.tokens} tokens: gateway/direct tok/s "
                    f"{statistics.median(ratios):.3f} (per repetition {', '.join(f'{r:.3f}' for r in ratios)}; "
                    "target ≥ 0.97)")
            client.close()
            long_client, long_stored, long_tokens = _long_prompt_ttft(serve, token, args.long_prompt)
            say(f"-- long prompt ({long_tokens} prompt tokens): client TTFT {long_client:.0f} ms, stored "
                f"{long_stored:.0f} ms → stored/client {long_stored / long_client:.3f} (target within 5 %)")
            time.sleep(1)
            before = census(serve)
            t0 = time.monotonic()
            flood = asyncio.run(_flood(serve, token, args))
            flood_s = time.monotonic() - t0
            deadline = time.monotonic() + args.settle
            after = census(serve)
            while time.monotonic() < deadline and (after.fds > before.fds or after.threads > before.threads
                                                   or (after.kv_used or 0) > (before.kv_used or 0)):
                time.sleep(1)
                after = census(serve)
            settle_s = time.monotonic() - deadline + args.settle
        finally:
            serve.stop()

    status_counts: dict[int, int] = {}
    for a in flood.background + flood.voice:
        status_counts[a.status] = status_counts.get(a.status, 0) + 1
    unexpected_5xx = sum(n for s, n in status_counts.items() if s >= 500)
    error_events = sum(a.error_event for a in flood.background + flood.voice)
    voice_ttft = [a.first_token_ms for a in flood.voice]
    print(f"-- flood ({flood_s:.0f} s): {args.background} streamed background, {args.half_open} half-open, "
          f"{args.idle} idle keep-alive connections")
    if flood.healthz_ms:
        print(f"   /healthz: {len(flood.healthz_ms)} answered, {flood.healthz_failed} failed; "
              f"p50 {percentile(flood.healthz_ms, 50):.1f} ms, p99 {percentile(flood.healthz_ms, 99):.1f} ms, "
              f"max {max(flood.healthz_ms):.1f} ms (target p99 ≤ 100)")
    print(f"   voice TTFT: {', '.join('-' if v is None else f'{v:.0f}' for v in voice_ttft)} ms (target ≤ 2000)")
    print(f"   answers by status: {dict(sorted(status_counts.items()))} (429 = class queue full, expected); "
          f"unexpected 5xx {unexpected_5xx}, error events in 200 streams {error_events}")
    print(f"   serve RSS: before {before.rss / MIB:.1f} MiB, peak {flood.rss_peak / MIB:.1f} MiB "
          f"→ +{(flood.rss_peak - before.rss) / MIB:.1f} MiB (target ≤ +100)")
    print(f"-- before: {before.line()}")
    print(f"-- after ({settle_s:.0f} s to settle): {after.line()}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({
            "latency_ms": lat, "first_token_ms": ttft, "stream_tok_s": rates, "ratios": ratios,
            "long_prompt": {"client_ms": long_client, "stored_ms": long_stored, "prompt_tokens": long_tokens},
            "healthz_ms": flood.healthz_ms, "healthz_failed": flood.healthz_failed, "voice_ttft_ms": voice_ttft,
            "status_counts": status_counts, "rss_before": before.rss, "rss_peak": flood.rss_peak,
            "before": before.__dict__, "after": after.__dict__,
        }, indent=1))
    return 0
