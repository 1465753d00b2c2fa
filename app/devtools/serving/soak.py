"""`hearth soak`: many clients of mixed classes against the gateway, some hanging up mid-stream.

Pass means the server comes back to where it started: no unexpected 5xx, every sequence freed
(KV cells in use back to 0, no slot or admission ticket left busy), thread and file-descriptor
counts of serve and the runner back to their warmed-up baseline, memory (RSS) stable.

Phases: start (or attach to) a serve → warm up (the same traffic for 15 % of the time, so thread
pools and keep-alive connections exist before the baseline) → baseline → soak for --minutes → wait until idle →
measure again → criteria. Queue-full (429) and queue-timeout (503) answers are the admission
policy doing its job under overload: counted and shown, not failures.
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from app.devtools.serve_process import runner_headers_of
from app.exposition import Scrape, parse_exposition
from app.gateway.relay import MAX_IDLE_PER_RUNNER
from app.protocols import sse
from app.store.db import DATABASE_NAME
from app.telemetry.stats import quantile

# Class mix of a household evening: (class, share, max_tokens, stream share).
MIX = (
    ("voice", 0.30, 12, 1.0),
    ("chat", 0.30, 24, 0.7),
    ("coding", 0.15, 24, 0.7),
    ("documents", 0.10, 16, 0.3),
    ("background", 0.15, 32, 0.2),
)
PROMPTS = (
    "What is the weather like on Mars?",
    "Write a short poem about a cat sleeping in the sun.",
    "Summarise: the meeting moved to Thursday because the room was booked.",
    "def fib(n):\n    # return the n-th Fibonacci number\n",
    "List three things to pack for a day at the beach.",
)
EXPECTED_REFUSALS = {"queue_full", "queue_timeout"}
MAX_THREADS_GROWTH = 2
MAX_FDS_GROWTH = 4
# SQLAlchemy's pool keeps up to pool_size + max_overflow (5 + 10) store connections once threads have
# needed them, each holding the database and its WAL open: bounded, so compared with the bound, not
# with the baseline.
MAX_STORE_FDS = 2 * (5 + 10) + 2
MAX_RSS_GROWTH_FRACTION = 0.15
MAX_RSS_GROWTH_MIB = 48
IDLE_TIMEOUT_S = 60.0
WARM_UP_SHARE = 0.15
POOL_FILL_CONNECTIONS = 48  # more than `hearth serve`'s default 32 threads
WARM_UP_MIN_S = 10.0


@dataclass
class Outcome:
    """One client request as the soak saw it."""

    klass: str
    stream: bool
    disconnect: bool
    status: int
    code: str | None = None
    ttft_ms: float | None = None
    total_ms: float = 0.0
    chunks: int = 0
    hung_up: bool = False  # the client really closed before the end of the stream
    error: str | None = None


@dataclass
class ProcessFigures:
    """Threads, open files and RSS of a group of processes (serve or one runner).

    `pooled` counts the relay's keep-alive connections to runners, kept on purpose in one shared pool
    (serve's gevent worker): they are bounded by the pool's MAX_IDLE_PER_RUNNER instead of compared with
    the baseline.
    Descriptors on the store (in `fd_kinds`) are bounded by SQLAlchemy's pool the same way.
    """

    threads: int
    fds: int
    rss_mib: float
    pooled: int = 0
    # What the descriptors are (socket, pipe, a file's name …), so a failed check says what grew.
    fd_kinds: dict[str, int] = field(default_factory=dict)


@dataclass
class SoakReport:
    """Everything `hearth soak` measured, and its verdict per criterion."""

    url: str
    streams: int
    seconds: float
    disconnect_share: float
    requests: int = 0
    by_status: dict = field(default_factory=dict)
    by_class: dict = field(default_factory=dict)
    hung_up: int = 0
    runner_cancelled: float = 0.0
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    completion_tokens: float = 0.0
    unexpected: list = field(default_factory=list)
    baseline: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    idle_after_s: float | None = None
    kv_cells_used: float | None = None
    runner_running: float | None = None
    runner_waiting: float | None = None
    slots_busy: int | None = None
    gateway_in_flight: float | None = None
    rss_samples_mib: list = field(default_factory=list)
    criteria: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """True when every criterion passed."""
        return all(self.criteria.values())


def _metrics(client: httpx.Client, url: str, headers: dict | None = None) -> Scrape:
    """The server's /metrics, parsed."""
    return parse_exposition(client.get(url, headers=headers, timeout=10).text)


def _fd_kinds(pid: int) -> Counter:
    """Open descriptors of a process by kind: 'socket', 'pipe', 'anon_inode:…' or a file's name."""
    kinds: Counter = Counter()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        entries = list(fd_dir.iterdir())
    except OSError:
        return kinds
    for entry in entries:
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        kinds[target.split(":[")[0] if ":[" in target else Path(target).name] += 1
    return kinds


def _group(pids: list[int], pool_ports: frozenset[int] = frozenset()) -> ProcessFigures:
    threads = fds = rss = pooled = 0
    kinds: Counter = Counter()
    for pid in pids:
        try:
            p = psutil.Process(pid)
            threads += p.num_threads()
            fds += p.num_fds()
            kinds += _fd_kinds(pid)
            rss += p.memory_info().rss
            if pool_ports:
                pooled += sum(1 for c in p.net_connections("tcp") if c.raddr and c.raddr.port in pool_ports)
        except psutil.NoSuchProcess:
            continue
    return ProcessFigures(threads, fds, rss / 2**20, pooled, dict(kinds))


def _runner_ports(runner_pids: list[int]) -> list[int]:
    """The loopback ports the runners were started on (their `--port` argument), in pid order."""
    ports = []
    for pid in runner_pids:
        try:
            args = psutil.Process(pid).cmdline()
        except psutil.NoSuchProcess:
            continue
        if "--port" in args:
            ports.append(int(args[args.index("--port") + 1]))
    return ports


def _figures(serve_pid: int) -> dict:
    serve, runners = _serve_pids(serve_pid)
    return {"serve": asdict(_group(serve, frozenset(_runner_ports(runners)))), "runner": asdict(_group(runners))}


def _serve_pids(serve_pid: int) -> tuple[list[int], list[int]]:
    """(serve arbiter + worker, runner arbiters + workers) under a serve's arbiter."""
    root = psutil.Process(serve_pid)
    kids = root.children(recursive=True)
    runners = [p.pid for p in kids if "runner" in " ".join(p.cmdline())]
    serve = [serve_pid] + [p.pid for p in kids if p.pid not in runners]
    return serve, runners


def _find_serve_pid(url: str) -> int | None:
    """The arbiter of the `hearth serve` listening on url's port on this machine, if any."""
    port = httpx.URL(url).port
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            p = psutil.Process(conn.pid)
            while p.parent() is not None and "serve" in " ".join(p.parent().cmdline()):
                p = p.parent()
            return p.pid
    return None


class Soak:
    """Drives the clients and collects outcomes."""

    def __init__(self, url: str, token: str, streams: int, seconds: float, disconnect: float, seed: int = 0):
        self.url = url.rstrip("/")
        self.token = token
        self.streams = streams
        self.seconds = seconds
        self.disconnect = disconnect
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self.classes = [c for c, *_ in MIX]

    def allowed_classes(self) -> list[str]:
        """The mix's classes this token may use (403s are dropped from the mix)."""
        allowed = []
        with httpx.Client(base_url=self.url, timeout=120) as c:
            for klass, *_ in MIX:
                r = c.post("/v1/completions", headers=self._headers(klass),
                           json={"prompt": "Hi", "max_tokens": 1})
                if r.status_code != 403:
                    allowed.append(klass)
        return allowed

    def _headers(self, klass: str) -> dict:
        return {"Authorization": f"Bearer {self.token}", "X-Hearth-Class": klass}

    def one(self, client: httpx.Client, rng: random.Random, force_stream: bool = False) -> Outcome:
        """Send one request of a random class; hang up after a few chunks when chosen to."""
        mix = [m for m in MIX if m[0] in self.classes]
        klass, _, max_tokens, stream_share = rng.choices(mix, weights=[m[1] for m in mix])[0]
        disconnect = rng.random() < self.disconnect
        stream = force_stream or disconnect or rng.random() < stream_share
        body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": max_tokens,
                "temperature": 0.7, "stream": stream}
        if disconnect:
            # Long enough that hanging up really happens mid-generation.
            body.update(max_tokens=min(128, max_tokens * 6), ignore_eos=True)
        out = Outcome(klass, stream, disconnect, status=0)
        t0 = time.monotonic()
        try:
            if stream:
                with client.stream("POST", "/v1/chat/completions", json=body, headers=self._headers(klass)) as r:
                    out.status = r.status_code
                    if r.status_code != 200:
                        r.read()
                        out.code = _code(r)
                    else:
                        hang_up_after = rng.randint(1, 4)
                        for ev in sse.events(r.iter_bytes()):
                            if out.ttft_ms is None:
                                out.ttft_ms = (time.monotonic() - t0) * 1000
                            if ev.done:
                                break
                            if b'"error"' in ev.data:
                                out.error = ev.data[:294].decode("utf-8", "replace")
                                out.code = ev.json()["error"].get("code")
                                break
                            out.chunks += 1
                            if disconnect and out.chunks >= hang_up_after:
                                out.hung_up = True
                                break  # leaving the block closes the connection
            else:
                r = client.post("/v1/chat/completions", json=body, headers=self._headers(klass))
                out.status = r.status_code
                if r.status_code == 200:
                    out.ttft_ms = r.json().get("timings", {}).get("ttft_ms")
                else:
                    out.code = _code(r)
        except httpx.HTTPError as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        out.total_ms = (time.monotonic() - t0) * 1000
        return out

    def run_clients(self, seconds: float, once: bool = False) -> None:
        """Every client sends requests back to back until the time is up (or once each)."""
        deadline = time.monotonic() + seconds
        seeds = [self.rng.randrange(2**32) for _ in range(self.streams)]

        def client_loop(seed: int) -> None:
            rng = random.Random(seed)
            # A fresh connection per request when hanging up: a closed stream cannot be reused.
            with httpx.Client(base_url=self.url, timeout=300) as client:
                while True:
                    out = self.one(client, rng, force_stream=once)
                    with self.lock:
                        self.outcomes.append(out)
                    if once or time.monotonic() >= deadline:
                        return

        threads = [threading.Thread(target=client_loop, args=(s,), daemon=True) for s in seeds]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def _code(r: httpx.Response) -> str | None:
    try:
        return r.json()["error"].get("code")
    except (ValueError, KeyError, AttributeError):
        return None



def _unexpected(o: Outcome) -> bool:
    if o.error and o.status == 0:
        return True  # transport error: the server dropped us
    if o.status >= 500 and o.code not in EXPECTED_REFUSALS:
        return True
    if o.status == 200 and o.error:
        return True  # an error event inside a stream
    return 400 <= o.status < 500 and o.code not in EXPECTED_REFUSALS


def _fill_thread_pool(url: str, token: str, n: int = POOL_FILL_CONNECTIONS) -> None:
    """Make gunicorn start every thread of its pool: n requests that hold a thread each until released.

    A pool thread is created whenever a request finds all threads busy and is kept for good, so a
    burst during the soak would otherwise look like a thread leak. Each request sends its headers,
    and its 2-byte body only once all are waiting, so each holds a thread in the body read.
    """
    u = httpx.URL(url)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {u.host}\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n").encode()
    socks = []
    try:
        for _ in range(n):
            sock = socket.create_connection((u.host, u.port), timeout=30)
            sock.sendall(head)
            socks.append(sock)
        time.sleep(1.0)
        for sock in socks:
            sock.sendall(b"{}")  # an invalid body: 400 at once, no model work
        for sock in socks:
            while sock.recv(65536):
                pass
    except OSError:
        pass  # a server with fewer threads or a stricter limit: the baseline is then just less warm
    finally:
        for sock in socks:
            sock.close()


def _runner_url(runner_pids: list[int]) -> str | None:
    ports = _runner_ports(runner_pids)
    return f"http://127.0.0.1:{ports[0]}" if ports else None


def _runner_headers(runner_pids: list[int]) -> dict:
    """The key serve gave its runner (every process of a runner holds the same environment)."""
    for pid in runner_pids:
        try:
            return runner_headers_of(pid)
        except psutil.NoSuchProcess:
            continue
    return {}


def _idle_state(client: httpx.Client, gateway: str, runner: str | None, runner_headers: dict | None = None) -> dict:
    g = _metrics(client, gateway + "/metrics")
    # Labelled per class and per model: the sums over all of them.
    state = {"gateway_in_flight": (g.value("hearth:class_in_flight") or 0.0) + (g.value("hearth:model_in_flight") or 0.0),
             "gateway_waiting": g.value("hearth:class_waiting") or 0.0}
    if runner:
        m = _metrics(client, runner + "/metrics", runner_headers)
        slots = client.get(runner + "/slots", headers=runner_headers, timeout=10).json()
        state.update(kv_cells_used=m.value("hearth:kv_cells_used"), runner_running=m.value("hearth:requests_running"),
                     runner_waiting=m.value("hearth:requests_waiting"),
                     runner_cancelled=m.value("hearth:requests_finished_total", {"reason": "cancelled"}) or 0.0,
                     slots_busy=sum(1 for s in slots if s.get("is_processing")))
    return state


def _is_idle(state: dict) -> bool:
    return (state["gateway_in_flight"] == 0 and state["gateway_waiting"] == 0
            and not state.get("kv_cells_used") and not state.get("runner_running")
            and not state.get("runner_waiting") and not state.get("slots_busy"))


def run_soak(url: str, token: str, streams: int = 32, minutes: float = 2.0, disconnect: float = 0.2,
             serve_pid: int | None = None, seed: int = 0, progress=None) -> SoakReport:
    """Soak a running gateway; `serve_pid` (found from the port when None) enables process figures."""
    say = progress or (lambda msg: None)
    seconds = minutes * 60
    soak = Soak(url, token, streams, seconds, disconnect, seed)
    report = SoakReport(url=url, streams=streams, seconds=seconds, disconnect_share=disconnect)
    soak.classes = soak.allowed_classes()
    warm_s = max(WARM_UP_MIN_S, seconds * WARM_UP_SHARE)
    say(f"classes: {', '.join(soak.classes)}; warming up for {warm_s:.0f} s")
    # The same traffic, shorter: thread pools (gunicorn's, and the relay's per-thread runner
    # connections) grow to what this load needs before the baseline is taken, so growth after the
    # soak means a leak, not a pool filling up.
    soak.run_clients(warm_s)
    soak.outcomes.clear()
    _fill_thread_pool(soak.url, token)
    serve_pid = serve_pid or _find_serve_pid(url)
    client = httpx.Client(timeout=30)
    _, runner_pids = _serve_pids(serve_pid) if serve_pid else ([], [])
    runner, runner_headers = _runner_url(runner_pids), _runner_headers(runner_pids)
    _wait_idle(client, soak.url, runner, IDLE_TIMEOUT_S, runner_headers)
    time.sleep(6)  # serve's keep-alive (5 s) closes the warm-up's idle client connections
    before = _idle_state(client, soak.url, runner, runner_headers)
    if serve_pid:
        report.baseline = _figures(serve_pid)
    say(f"baseline {report.baseline}; soaking {streams} streams for {seconds:.0f} s")

    sampling = threading.Event()

    def sample_rss() -> None:
        while not sampling.wait(5):
            if serve_pid:
                s, r = _serve_pids(serve_pid)
                report.rss_samples_mib.append(round(_group(s).rss_mib + _group(r).rss_mib, 1))

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    soak.run_clients(seconds)
    sampling.set()
    t_end = time.monotonic()
    idle = _wait_idle(client, soak.url, runner, IDLE_TIMEOUT_S, runner_headers)
    report.idle_after_s = round(time.monotonic() - t_end, 2) if idle else None
    time.sleep(6)
    after = _idle_state(client, soak.url, runner, runner_headers)
    if serve_pid:
        report.after = _figures(serve_pid)
    client.close()

    outs = soak.outcomes
    report.requests = len(outs)
    report.by_status = dict(Counter(f"{o.status} {o.code}" if o.code else str(o.status) for o in outs))
    report.by_class = dict(Counter(o.klass for o in outs))
    report.hung_up = sum(o.hung_up for o in outs)
    report.runner_cancelled = (after.get("runner_cancelled") or 0) - (before.get("runner_cancelled") or 0)
    ttfts = sorted(o.ttft_ms for o in outs if o.ttft_ms is not None and o.status == 200)
    report.ttft_p50_ms = quantile(ttfts, 0.5)
    report.ttft_p95_ms = quantile(ttfts, 0.95)
    report.unexpected = [asdict(o) for o in outs if _unexpected(o)][:20]
    for key in ("kv_cells_used", "runner_running", "runner_waiting", "slots_busy", "gateway_in_flight"):
        setattr(report, key, after.get(key))
    report.criteria = _criteria(report, outs, after)
    return report


def _wait_idle(client: httpx.Client, gateway: str, runner: str | None, timeout_s: float,
               runner_headers: dict | None = None) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _is_idle(_idle_state(client, gateway, runner, runner_headers)):
            return True
        time.sleep(0.5)
    return False


def _store_fds(figures: dict) -> int:
    """Descriptors on the SQLite store (database, WAL, shared memory) in a ProcessFigures dict."""
    return sum(n for kind, n in figures.get("fd_kinds", {}).items() if kind.startswith(DATABASE_NAME))


def _criteria(report: SoakReport, outs: list[Outcome], after: dict) -> dict[str, bool]:
    c = {
        "requests answered": report.requests > 0 and any(o.status == 200 for o in outs),
        "no unexpected errors (5xx, 4xx, dropped connections)": not any(_unexpected(o) for o in outs),
        "idle again (no stuck slot or ticket)": report.idle_after_s is not None and _is_idle(after),
        "KV cells in use back to 0": after.get("kv_cells_used") in (0, 0.0, None) and report.idle_after_s is not None,
        "disconnected sequences freed": report.hung_up > 0 and not after.get("runner_running")
        and report.runner_cancelled >= 1 if report.disconnect_share > 0 else True,
    }
    if report.baseline:
        for group in ("serve", "runner"):
            b, a = report.baseline[group], report.after[group]
            c[f"{group} threads back to baseline"] = a["threads"] <= b["threads"] + MAX_THREADS_GROWTH
            store_b, store_a = _store_fds(b), _store_fds(a)
            c[f"{group} fds back to baseline"] = (
                a["fds"] - a["pooled"] - store_a <= b["fds"] - b["pooled"] - store_b + MAX_FDS_GROWTH
                and a["pooled"] <= MAX_IDLE_PER_RUNNER and store_a <= MAX_STORE_FDS)
            c[f"{group} memory stable"] = a["rss_mib"] <= b["rss_mib"] * (1 + MAX_RSS_GROWTH_FRACTION) + \
                MAX_RSS_GROWTH_MIB
    return c


def format_report(r: SoakReport) -> str:
    """The human table: figures, then PASS/FAIL per criterion."""
    lines = [
        f"hearth soak: {r.streams} streams × {r.seconds:.0f} s against {r.url}, disconnect share {r.disconnect_share}",
        f"  requests            {r.requests}  by class {r.by_class}",
        f"  answers             {r.by_status}",
        f"  hung up mid-stream  {r.hung_up} (runner cancelled {r.runner_cancelled:.0f})",
        f"  TTFT p50 / p95      {_ms(r.ttft_p50_ms)} / {_ms(r.ttft_p95_ms)}",
        f"  idle again after    {'-' if r.idle_after_s is None else f'{r.idle_after_s} s'}",
        (f"  after idle          KV cells used {r.kv_cells_used}, runner running {r.runner_running}, "
         f"waiting {r.runner_waiting}, busy slots {r.slots_busy}, gateway in flight {r.gateway_in_flight}"),
    ]
    for group in ("serve", "runner"):
        if r.baseline.get(group):
            b, a = r.baseline[group], r.after[group]
            pool = f" (of which runner keep-alive {b['pooled']} → {a['pooled']})" if group == "serve" else ""
            lines.append(f"  {group:<7} threads {b['threads']} → {a['threads']}, fds {b['fds']} → {a['fds']}{pool}, "
                         f"RSS {b['rss_mib']:.0f} → {a['rss_mib']:.0f} MiB")
            grew = {k: f"{b.get('fd_kinds', {}).get(k, 0)} → {n}" for k, n in a.get("fd_kinds", {}).items()
                    if n > b.get("fd_kinds", {}).get(k, 0)}
            if grew:
                lines.append(f"  {group:<7} descriptors that grew: {grew}")
    if r.rss_samples_mib:
        lines.append(f"  RSS serve+runner every 5 s (MiB): {r.rss_samples_mib}")
    for o in r.unexpected[:5]:
        lines.append(f"  unexpected: {o}")
    lines.append("")
    for name, ok in r.criteria.items():
        lines.append(f"  {'PASS' if ok else 'FAIL'}  {name}")
    lines.append(f"  {'PASS' if r.passed else 'FAIL'}  overall")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


def main(args) -> int:
    """`hearth soak`: against --url with --token, or a fresh serve on the default model."""
    progress = None if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.url:
        if not args.token:
            print("hearth soak: --url needs --token (a token allowed the classes to soak)", file=sys.stderr)
            return 2
        report = run_soak(args.url, args.token, args.streams, args.minutes, args.disconnect, seed=args.seed,
                          progress=progress)
    else:
        report = _soak_fresh_serve(args, progress)
    print(json.dumps(asdict(report) | {"passed": report.passed}, indent=2) if args.json else format_report(report))
    return 0 if report.passed else 1


def _soak_fresh_serve(args, progress) -> SoakReport:
    from app.devtools.serve_process import ServeProcess, prepare_data
    from app.paths import data_dir
    from app.residency.default_model import ensure_default_model

    model = Path(args.model) if args.model else ensure_default_model(data_dir(), progress=progress is not None)
    with tempfile.TemporaryDirectory(prefix="hearth-soak-") as tmp:
        data = Path(tmp) / "data"
        models = Path(tmp) / "models"
        models.mkdir()
        classes = [c for c, *_ in MIX]
        # One token stands for every client here: it may hold whole classes (member_class_share 1).
        tokens = prepare_data(data, settings={"runner_ctx": args.ctx, "runner_parallel": args.parallel,
                                              "member_class_share": 1.0},
                              tokens=[("soak", "chat", classes)])
        serve = ServeProcess(data, models, model, Path(tmp) / "serve.log")
        try:
            return run_soak(serve.url, tokens["soak"], args.streams, args.minutes, args.disconnect,
                            serve_pid=serve.proc.pid, seed=args.seed, progress=progress)
        finally:
            serve.stop()
