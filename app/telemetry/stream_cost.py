"""What a stream costs the box: CPU seconds `hearth serve` and its local runners spent per 1,000 generated tokens.

The sampler calls `StreamCost.sample` with each collection: the processes' CPU times (psutil, user + system; a
runner counted with its children: gunicorn's arbiter and worker) and the tokens serve has relayed so far, as running
totals. A runner that stops or restarts adds what it spent while it was seen: totals never go back. Readers (the
Overview, /metrics) take the difference between the newest point and the oldest one inside their window, so they
never collect. Remote nodes' CPU is not this box's: their tokens count, their CPU does not (the figure is what this
NAS spends).
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import psutil
from prometheus_client.core import GaugeMetricFamily

MAX_AGE_S = 7 * 24 * 3600  # the Overview's longest range
STEP_S = 10.0  # one kept point per step (7 days of points at 1 s would be 600k), the newest always replaced
WINDOW_METRIC_S = 300.0  # the /metrics figure's window: the Overview's default range
PROCESSES = ("serve", "runner")


@dataclass(frozen=True)
class Totals:
    """Running totals at one moment: CPU seconds of serve and of the local runners, tokens relayed."""

    at: float
    serve_cpu_s: float
    runner_cpu_s: float
    tokens: float


@dataclass(frozen=True)
class Cost:
    """CPU seconds per 1,000 tokens over a window, per process, and what it was measured over."""

    serve_per_1k: float
    runner_per_1k: float
    tokens: float
    window_s: float  # the span of the points the figure came from

    def per_1k(self, process: str) -> float:
        """The figure of `process` ('serve' or 'runner')."""
        return self.serve_per_1k if process == "serve" else self.runner_per_1k


def counter_total(counter: Any) -> float:
    """A prometheus_client Counter's value summed over its labels (serve's tokens: gateway_completion_tokens)."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def cpu_s(proc: Any) -> float:
    """User + system CPU seconds of one psutil process."""
    t = proc.cpu_times()
    return t.user + t.system


class StreamCost:
    """CPU per 1,000 tokens of serve and its runners from running totals kept in a thinned ring."""

    def __init__(self, tokens_total: Callable[[], float], clock: Callable[[], float] = time.time, ps: Any = psutil,
                 serve_pid: int | None = None):
        self.tokens_total = tokens_total
        self.clock = clock
        self.ps = ps
        self._serve = ps.Process(serve_pid or os.getpid())
        self._runners: dict[int, tuple[Any, float]] = {}  # pid → (its process, CPU seconds of its tree last read)
        self._runner_total_s = 0.0
        self._points: deque[Totals] = deque()

    def _tree_cpu_s(self, proc: Any) -> float:
        total = cpu_s(proc)
        for child in proc.children(recursive=True):
            try:
                total += cpu_s(child)
            except self.ps.NoSuchProcess:
                continue
        return total

    def _runner_cpu_s(self, pids: Iterable[int]) -> float:
        """The runners' running total: what each seen runner spent since it was first seen."""
        seen: dict[int, tuple[Any, float]] = {}
        for pid in pids:
            known = self._runners.get(pid)
            try:
                proc = known[0] if known is not None else self.ps.Process(pid)
                now_s = self._tree_cpu_s(proc)
            except self.ps.NoSuchProcess:
                continue
            # A runner first seen counts from now: its start (loading the model) is not a stream's cost.
            if known is not None:
                self._runner_total_s += max(0.0, now_s - known[1])
            seen[pid] = (proc, now_s)
        self._runners = seen
        return self._runner_total_s

    def sample(self, runner_pids: Iterable[int]) -> Totals:
        """Read the processes' CPU times and the tokens so far; keep the point (one per STEP_S, the newest always)."""
        now = self.clock()
        point = Totals(now, cpu_s(self._serve), self._runner_cpu_s(runner_pids), float(self.tokens_total()))
        points = self._points
        # The newest point replaces the one before it while that one is less than a step after the last kept one.
        if len(points) >= 2 and points[-1].at - points[-2].at < STEP_S:
            points[-1] = point
        else:
            points.append(point)
        while points and now - points[0].at > MAX_AGE_S:
            points.popleft()
        return point

    def over(self, window_s: float) -> Cost | None:
        """CPU per 1,000 tokens between the newest point and the oldest one inside the window (None: no tokens)."""
        points = list(self._points)
        if len(points) < 2:
            return None
        last = points[-1]
        first = points[min(bisect_left([p.at for p in points], last.at - window_s), len(points) - 2)]
        tokens = last.tokens - first.tokens
        if tokens <= 0:
            return None
        return Cost(serve_per_1k=(last.serve_cpu_s - first.serve_cpu_s) * 1000 / tokens,
                    runner_per_1k=(last.runner_cpu_s - first.runner_cpu_s) * 1000 / tokens,
                    tokens=tokens, window_s=last.at - first.at)


class StreamCostCollector:
    """/metrics: hearth:stream_cpu_seconds_per_1k_tokens{process}, over the last WINDOW_METRIC_S (read, not collected)."""

    def __init__(self, cost: StreamCost):
        self.cost = cost

    def collect(self):
        """The gauge family; no sample while no token was generated in the window."""
        family = GaugeMetricFamily("hearth:stream_cpu_seconds_per_1k_tokens",
                                   f"CPU seconds hearth serve and its local runners spent per 1,000 generated tokens, "
                                   f"last {WINDOW_METRIC_S:g} s (process CPU times)", labels=["process"])
        cost = self.cost.over(WINDOW_METRIC_S)
        if cost is not None:
            for process in PROCESSES:
                family.add_metric([process], cost.per_1k(process))
        yield family
