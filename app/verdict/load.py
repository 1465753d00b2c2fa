"""The bench's load client: sends a planned run of requests to one target, streamed, and samples it meanwhile.

Per request the client keeps raw timings (seconds from the run's start) and the text it received;
during each run a sampler reads the server's /metrics (KV cells, preemptions, running/waiting,
speculative decoding's counters) and the device's utilisation, and the counters are read once more
just before the first request and after the last ("phase" samples), so a run's drafts are counted
whole. `summarise` derives every figure from those raw rows and samples.
"""

from __future__ import annotations

import threading
import time

import httpx
import psutil

from app.exposition import Scrape, parse_exposition
from app.hardware import nvml_gpus
from app.policy import SLO_HEADER, ClassPolicy, slo_header
from app.protocols import sse
from app.verdict.results import RunResult, summarise
from app.verdict.scenarios import PlannedRequest
from app.verdict.targets import Target

SAMPLE_INTERVAL_S = 0.2
# Speculative decoding's counters (llama-server's names, which the hearth runner exports too): sample key → series.
SPEC_COUNTERS = {
    "spec_drafts_total": "llamacpp:spec_decode_num_drafts_total",
    "spec_draft_tokens_total": "llamacpp:spec_decode_num_draft_tokens_total",
    "spec_accepted_total": "llamacpp:spec_decode_num_accepted_tokens_total",
}


def spec_counters(values: Scrape) -> dict:
    """The speculative decoding counters of one scrape (None where the server exports none)."""
    out = {key: values.value(name) for key, name in SPEC_COUNTERS.items()}
    out["spec_drafting"] = values.value("hearth:spec_drafting")
    return out


def _scrape(http: httpx.Client, target: Target) -> Scrape:
    """The target's /metrics now; empty when it has none or does not answer (the request timings still count)."""
    try:
        r = http.get(f"{target.metrics_url or target.url}/metrics", headers=target.metrics_headers)
        return parse_exposition(r.text) if r.status_code == 200 else Scrape()
    except (httpx.HTTPError, ValueError):
        return Scrape()


# The cost rule per draft source (a hearth runner's, app/engine/speculation.py decide): sample key → gauge.
RULE_GAUGES = {
    "acceptance": "hearth:spec_source_acceptance",
    "kept_tokens": "hearth:spec_source_kept_tokens",
    "cost_tokens": "hearth:spec_source_cost_tokens",
    "length": "hearth:spec_source_draft_length",
}


def rule_counters(values: Scrape) -> dict:
    """Per draft source: the cost rule's decisions so far (draft, cut, explore) and its last decision's figures;
    {} for a server that exports none (llama-server)."""
    out: dict[str, dict] = {}
    for labels, v in values.series("hearth:spec_source_decisions_total"):
        out.setdefault(labels.get("source", ""), {})[labels.get("decision", "")] = v
    for key, name in RULE_GAUGES.items():
        for labels, v in values.series(name):
            out.setdefault(labels.get("source", ""), {})[key] = v
    return out


def phase_sample(http: httpx.Client, target: Target, phase: str, t_s: float) -> dict:
    """The counters just before the first request ("before") or after the last ("after"); no KV or load figures."""
    values = _scrape(http, target)
    return {"t_s": t_s, "phase": phase, **spec_counters(values), "spec_rule": rule_counters(values)}


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
               "max_tokens": req.max_tokens, "status": "ok", "error": None, "server_timings": None,
               "output": None}
        pieces: list[str] = []
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
                for ev in sse.events(resp.iter_bytes()):
                    if ev.done:
                        break
                    chunk = ev.json()
                    if "error" in chunk:
                        raise RuntimeError(str(chunk["error"].get("message", chunk["error"]))[:300])
                    text = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
                    if text:
                        pieces.append(text)
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
            # The text as received: greedy arms of one prompt must agree byte for byte.
            row["output"] = "".join(pieces)
            if row["completion_tokens"] is None:
                row["completion_tokens"] = len(pieces)
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
        with httpx.Client(timeout=5.0) as mclient:
            before = phase_sample(mclient, target, "before", 0.0)
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
                    values = _scrape(mclient, target)
                    s["kv_used"] = values.first("hearth:kv_cells_used", "llamacpp:kv_cache_tokens")
                    s["kv_total"] = values.value("hearth:kv_cells_total")
                    s["kv_util"] = values.value("llamacpp:kv_cache_usage_ratio")
                    if s["kv_used"] is not None and s["kv_total"]:
                        s["kv_util"] = s["kv_used"] / s["kv_total"]
                    s["running"] = values.first("hearth:requests_running", "llamacpp:requests_processing")
                    s["waiting"] = values.first("hearth:requests_waiting", "llamacpp:requests_deferred")
                    s["preemptions_total"] = values.value("hearth:preemptions_total")
                    s.update(spec_counters(values))
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
        with httpx.Client(timeout=5.0) as mclient:
            after = phase_sample(mclient, target, "after", time.monotonic() - t0)
        samples[:0] = [before]
        samples.append(after)
    lost = [planned[i].idx for i, r in enumerate(rows) if r is None]
    if lost:
        raise RuntimeError(f"requests {lost} did not finish within {timeout_s} s on {target.label}")
    run = RunResult(target.label, target.kind, level, [r for r in rows if r is not None], samples, slots=target.slots)
    run.summary = summarise(run.requests, run.samples, policies)
    return run
