"""The CPU a stream costs serve and its runners: StreamCost against psutil's own reading of real processes."""

import os
import subprocess
import sys
from types import SimpleNamespace

import psutil
from prometheus_client import CollectorRegistry, Counter, generate_latest

from app.telemetry.stream_cost import STEP_S, StreamCost, StreamCostCollector, counter_total, cpu_s
from tests.helpers import wait_until

# A runner stand-in: a process that burns CPU until its stdin closes.
BURN = "import sys, threading\nstop = threading.Event()\nthreading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()\nwhile not stop.is_set():\n    sum(range(10000))\n"
# CPU times move in clock ticks (10 ms); each figure is read at two moments, a few microseconds apart from psutil's.
TOLERANCE_S = 0.05


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def tree_cpu_s(pid: int) -> float:
    p = psutil.Process(pid)
    return cpu_s(p) + sum(cpu_s(c) for c in p.children(recursive=True))


def test_cpu_per_1k_tokens_is_what_psutil_reads_of_the_processes_over_the_same_work():
    clock, tokens = Clock(), [0.0]
    cost = StreamCost(lambda: tokens[0], clock=clock)
    runner = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE)
    try:
        cost.sample([runner.pid])
        serve_before, runner_before = cpu_s(psutil.Process(os.getpid())), tree_cpu_s(runner.pid)
        # Work in both: this process (serve) computes without a pause, the runner burns, until psutil sees enough of
        # each.
        wait_until(lambda: sum(range(200000)) >= 0 and cpu_s(psutil.Process(os.getpid())) - serve_before >= 0.2
                   and tree_cpu_s(runner.pid) - runner_before >= 0.3, timeout_s=60, every_s=0)
        serve_after, runner_after = cpu_s(psutil.Process(os.getpid())), tree_cpu_s(runner.pid)
        tokens[0] = 2000.0
        clock.now += STEP_S
        cost.sample([runner.pid])
    finally:
        runner.stdin.close()
        runner.wait(10)
    got = cost.over(300)
    assert got is not None and got.tokens == 2000 and got.window_s == STEP_S
    serve_s, runner_s = got.serve_per_1k * 2, got.runner_per_1k * 2  # back to CPU seconds over 2,000 tokens
    # StreamCost's readings enclose psutil's: never less, more by a tick or so at most.
    assert serve_after - serve_before <= serve_s + 0.011 <= serve_after - serve_before + TOLERANCE_S
    assert runner_after - runner_before <= runner_s + 0.011 <= runner_after - runner_before + TOLERANCE_S


class FakeProcess:
    """A process whose CPU seconds the test sets; gone when `gone` is set."""

    def __init__(self, cpu: dict, pid: int):
        self.cpu, self.pid = cpu, pid

    def cpu_times(self):
        if self.pid not in self.cpu:
            raise psutil.NoSuchProcess(self.pid)
        return SimpleNamespace(user=self.cpu[self.pid], system=0.0)

    def children(self, recursive=False):
        return []


class FakePs:
    NoSuchProcess = psutil.NoSuchProcess

    def __init__(self):
        self.cpu = {1: 0.0}

    def Process(self, pid):  # noqa: N802 (psutil's name)
        if pid not in self.cpu:
            raise psutil.NoSuchProcess(pid)
        return FakeProcess(self.cpu, pid)


def test_a_runner_that_restarts_adds_what_it_spent_and_the_window_picks_its_oldest_point():
    ps, clock, tokens = FakePs(), Clock(), [0.0]
    cost = StreamCost(lambda: tokens[0], clock=clock, ps=ps, serve_pid=1)
    ps.cpu[7] = 5.0  # loading the model before it was first seen: not a stream's cost
    cost.sample([7])
    for _ in range(3):
        clock.now += STEP_S
        ps.cpu[1] += 0.1
        ps.cpu[7] += 1.0
        tokens[0] += 1000
        cost.sample([7])
    del ps.cpu[7]  # it stopped; a new runner takes its place
    ps.cpu[8] = 3.0
    clock.now += STEP_S
    cost.sample([8])
    clock.now += STEP_S
    ps.cpu[8] += 2.0
    tokens[0] += 1000
    cost.sample([8])
    whole = cost.over(3600)
    assert whole.tokens == 4000 and round(whole.runner_per_1k, 6) == round(5.0 / 4, 6)
    assert round(whole.serve_per_1k, 6) == round(0.3 / 4, 6)
    last = cost.over(STEP_S)  # the last step only: the new runner's 2 s over 1,000 tokens
    assert last.tokens == 1000 and round(last.runner_per_1k, 6) == 2.0


def test_metrics_family_and_counter_total():
    registry = CollectorRegistry()
    c = Counter("x_tokens", "t", ["class"], registry=registry)
    c.labels("chat").inc(600)
    c.labels("voice").inc(400)
    assert counter_total(c) == 1000
    ps, clock = FakePs(), Clock()
    cost = StreamCost(lambda: counter_total(c), clock=clock, ps=ps, serve_pid=1)
    ps.cpu[7] = 0.0
    text = generate_latest(_registry(cost)).decode()
    assert "hearth:stream_cpu_seconds_per_1k_tokens" in text and 'process="serve"' not in text  # nothing yet
    cost.sample([7])
    clock.now += STEP_S
    ps.cpu[1], ps.cpu[7] = 0.5, 2.0
    c.labels("chat").inc(1000)
    cost.sample([7])
    text = generate_latest(_registry(cost)).decode()
    assert 'hearth:stream_cpu_seconds_per_1k_tokens{process="serve"} 0.5' in text
    assert 'hearth:stream_cpu_seconds_per_1k_tokens{process="runner"} 2.0' in text


def _registry(cost):
    r = CollectorRegistry()
    r.register(StreamCostCollector(cost))
    return r
