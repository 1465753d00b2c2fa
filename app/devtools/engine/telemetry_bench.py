"""`hearth bench sampling`: CPU cost of the 1-second telemetry job against a real runner.

Target (issue: dashboard): sampling all runners and the host costs ≤ 2 % of one core. Counted:
our process (collect + parse + the writer's commit) and the runner answering /metrics and /slots.
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from app.gateway.admission import Admission
from app.residency.manager import ModelState
from app.residency.runner_spec import RunnerSpec
from app.residency.supervisor import RunnerProcess
from app.store.db import make_engine, upgrade
from app.store.writer import StoreWriter
from app.telemetry.sampler import Sampler


def _cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def run_sampling(args, model_path: str) -> int:
    """Start a runner, call the sampler `calls` times, report CPU per call and per second of sampling."""
    spec = RunnerSpec(model_name=Path(model_path).stem, model_path=model_path, n_ctx=args.ctx,
                      parallel=args.parallel, threads=args.threads)
    runner = RunnerProcess(spec).start()
    with tempfile.TemporaryDirectory(prefix="hearth-bench-") as tmp:
        db_engine = make_engine(Path(tmp) / "hearth.db")
        upgrade(db_engine)
        writer = StoreWriter(db_engine)
        writer.start()
        status = [{"name": spec.model_name, "state": ModelState.READY, "pid": runner.pid, "rss_bytes": 0,
                   "nodes": [{"label": "local", "url": runner.url, "local": True, "healthy": True}]}]
        sampler = Sampler(writer, lambda: status, Admission().snapshot)
        try:
            sampler.sample_all()  # warm: connection, NVML probe, series rows
            writer.flush()
            procs = [psutil.Process(pid) for pid in runner.pids()]
            walls = []
            u0 = resource.getrusage(resource.RUSAGE_SELF)
            r0 = _cpu_s(procs)
            for _ in range(args.calls):
                t0 = time.perf_counter()
                readings = sampler.sample_all()
                walls.append(time.perf_counter() - t0)
            writer.flush()
            u1 = resource.getrusage(resource.RUSAGE_SELF)
            r1 = _cpu_s(procs)
        finally:
            writer.stop()
            db_engine.dispose()
            runner.stop()
    ours = (u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime) / args.calls
    theirs = (r1 - r0) / args.calls
    print(f"{args.calls} calls, {readings} readings each (host, GPUs if any, 1 runner)")
    print(f"wall per call: median {statistics.median(walls) * 1000:.2f} ms, max {max(walls) * 1000:.2f} ms")
    print(f"CPU per call: hearth {ours * 1000:.2f} ms (collect + store), runner {theirs * 1000:.2f} ms (answering)")
    print(f"at one call per second: {100 * (ours + theirs):.2f} % of one core (target ≤ 2 %)")
    return 0
