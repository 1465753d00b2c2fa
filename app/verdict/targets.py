"""The servers the bench measures: hearth runners and a stock llama-server it starts, or a URL it is given.

Every target the bench starts is started with the same constants (model, context, slots, batch,
threads, GPU layers), so only the scheduling (and, on a speculation axis, the drafting) differs
between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from app.verdict.scenarios import PromptCutter
from app.verdict.spec import label, off_arm_args, runner_spec_type, split_label


@dataclass
class Target:
    """A server the client measures: a runner the bench started, or a URL it was given."""

    label: str  # what the tables call it: the mode for hearth runners, "llama-server", "target"; +arm (spec)
    url: str
    kind: str  # "hearth", "llama-server" or "external"
    model: str  # the model name sent in requests
    pid: int | None = None  # the process whose CPU is the device's utilisation
    threads: int | None = None
    process: object = None  # RunnerProcess to stop at the end
    slots: int | None = None  # sequence slots it was started with; None when the bench did not start it
    headers: dict | None = None  # sent with every request (a gateway's token)
    metrics_url: str | None = None  # where the sampler reads KV and queue figures (default: url)
    metrics_headers: dict | None = None  # sent to metrics_url (the key serve gave its runner)

    @property
    def mode(self) -> str:
        """The scheduling mode for hearth runners; the server kind otherwise (the label without its arm)."""
        return split_label(self.label)[0]

    @property
    def arm(self) -> str | None:
        """Its speculation arm (app.verdict.spec), None when the session has no speculation axis."""
        return split_label(self.label)[1]


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


def start_hearth(c: Constants, mode: str, arm: str | None = None, timeout_s: float = 180) -> Target:
    """A hearth runner in `mode` (and speculation arm) with the constants; waits until it serves."""
    from app.residency.runner_spec import RunnerSpec
    from app.residency.supervisor import RunnerProcess

    extra = (("--budget", str(c.token_budget)) if c.token_budget else ()) + off_arm_args(arm)
    spec = RunnerSpec(model_name=c.model_name, model_path=c.model_path, kind="hearth", n_ctx=c.n_ctx,
                      parallel=c.parallel, n_batch=c.n_batch, threads=c.threads, gpu_layers=c.gpu_layers,
                      mode=mode, extra_args=extra, spec_type=runner_spec_type(arm, "hearth"))
    proc = RunnerProcess(spec).start(timeout_s)
    return Target(label(mode, arm), proc.url, "hearth", c.model_name, pid=proc.pid, threads=c.threads, process=proc,
                  slots=c.parallel)


def start_llama_server(c: Constants, binary: str, arm: str | None = None, timeout_s: float = 180) -> Target:
    """Stock llama-server with the same model, context, slots (-np), batch and threads (and --spec-type of the arm)."""
    from app.residency.runner_spec import RunnerSpec
    from app.residency.supervisor import RunnerProcess

    spec = RunnerSpec(model_name=c.model_name, model_path=c.model_path, kind="llama-server", binary_path=binary,
                      n_ctx=c.n_ctx, parallel=c.parallel, n_batch=c.n_batch, threads=c.threads,
                      gpu_layers=c.gpu_layers, spec_type=runner_spec_type(arm, "llama-server"))
    proc = RunnerProcess(spec).start(timeout_s)
    return Target(label("llama-server", arm), proc.url, "llama-server", c.model_name, pid=proc.pid,
                  threads=c.threads, process=proc, slots=c.parallel)


def external_target(url: str, model: str) -> Target:
    """Any OpenAI-compatible server; its device utilisation is the whole machine's."""
    return Target("target", url.rstrip("/"), "external", model)


def stop_targets(targets: list[Target]) -> None:
    """Stop the runners the bench started."""
    for t in targets:
        if t.process is not None:
            t.process.stop()


def http_cutter(url: str, headers: dict | None = None) -> PromptCutter:
    """Prompt cutting with the server's /tokenize and /detokenize; estimated lengths if it has neither."""
    try:
        r = httpx.post(f"{url}/tokenize", json={"content": "hello"}, headers=headers, timeout=10)
        d = httpx.post(f"{url}/detokenize", json={"tokens": r.json()["tokens"]}, headers=headers, timeout=10)
        d.json()["content"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return PromptCutter()

    def tokenize(text: str) -> list[int]:
        return httpx.post(f"{url}/tokenize", json={"content": text}, headers=headers, timeout=60).json()["tokens"]

    def detokenize(tokens: list[int]) -> str:
        return httpx.post(f"{url}/detokenize", json={"tokens": tokens}, headers=headers, timeout=60).json()["content"]

    return PromptCutter(tokenize, detokenize)


def serve_ready(target: Target) -> None:
    """After the warm-up has loaded serve's runner: its slots, and its /metrics for the sampler."""
    target.metrics_url = target.process.runner_url()
    target.metrics_headers = target.process.runner_headers()
    props = httpx.get(f"{target.metrics_url}/props", headers=target.metrics_headers, timeout=10).json()
    target.slots = props.get("total_slots")


def warm_up(target: Target) -> None:
    """One short request, discarded: the first request of a process pays for cold caches (serve: loads its model)."""
    r = httpx.post(f"{target.url}/v1/completions", timeout=300, headers=target.headers,
                   json={"model": target.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0})
    if target.kind == "serve":
        if r.status_code != 200:
            raise RuntimeError(f"hearth serve did not answer the warm-up: HTTP {r.status_code}: {r.text[:300]}")
        serve_ready(target)
