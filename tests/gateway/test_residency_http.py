"""Residency through `hearth serve`: eviction under a budget that fits one model, and no runner outlives serve."""

import os
import signal
import sqlite3
import time

import psutil

from app.devtools.serve_process import ServeProcess as Serve
from app.devtools.serve_process import prepare_data
from app.residency.catalog import scan
from app.residency.estimate import estimate_memory


def test_budget_that_fits_one_model_evicts_the_idle_one(tmp_path, gemma_path, models_dir):
    one = estimate_memory(scan(None, gemma_path)[0], 512, 2).total_bytes
    data = tmp_path / "data"
    tokens = prepare_data(data, settings={"runner_ctx": 512, "runner_parallel": 2, "runner_threads": 2,
                                          "memory_limit_mb": int(one * 1.5 / 2**20)},
                          tokens=[("alice", "chat", [])])
    s = Serve(data, models_dir, gemma_path, tmp_path / "serve.log")
    try:
        hdr = {"Authorization": f"Bearer {tokens['alice']}"}
        for model in ("gemma-3-270m-q4_k_m", "gemma-b", "gemma-3-270m-q4_k_m"):
            r = s.client.post("/v1/completions", headers=hdr, json={"model": model, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert len(s.runner_arbiters()) == 1
        time.sleep(0.5)
        with sqlite3.connect(data / "hearth.db") as db:
            events = db.execute("select model_name, event, cold_start_ms from residency_events order by id").fetchall()
        assert [(m, e) for m, e, _ in events] == [
            ("gemma-3-270m-q4_k_m", "load"), ("gemma-3-270m-q4_k_m", "evict"), ("gemma-b", "load"),
            ("gemma-b", "evict"), ("gemma-3-270m-q4_k_m", "load"),
        ]
        assert all(ms > 0 for _, e, ms in events if e == "load")
    finally:
        s.stop()


def test_runners_do_not_outlive_a_killed_serve(tmp_path, gemma_path, models_dir):
    data = tmp_path / "data"
    tokens = prepare_data(data, settings={"runner_ctx": 512, "runner_parallel": 2, "runner_threads": 2},
                          tokens=[("alice", "chat", [])])
    s = Serve(data, models_dir, gemma_path, tmp_path / "serve.log")
    r = s.client.post("/v1/completions", headers={"Authorization": f"Bearer {tokens['alice']}"},
                      json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200
    runners = s.runner_processes()
    assert runners
    # kill -9 the whole serve (arbiter and worker): nobody gets to stop the runners politely.
    for p in psutil.Process(s.proc.pid).children():
        if p not in runners:
            os.kill(p.pid, signal.SIGKILL)
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait()
    gone, alive = psutil.wait_procs(runners, timeout=15)
    assert not alive, [p.cmdline() for p in alive]
    s.stop()


def test_sigterm_stops_runners_cleanly(tmp_path, gemma_path, models_dir):
    data = tmp_path / "data"
    tokens = prepare_data(data, settings={"runner_ctx": 512, "runner_parallel": 2, "runner_threads": 2},
                          tokens=[("alice", "chat", [])])
    s = Serve(data, models_dir, gemma_path, tmp_path / "serve.log")
    s.client.post("/v1/completions", headers={"Authorization": f"Bearer {tokens['alice']}"},
                  json={"prompt": "Hi", "max_tokens": 2})
    runners = s.runner_processes()
    assert runners
    s.stop()
    assert s.proc.returncode == 0
    gone, alive = psutil.wait_procs(runners, timeout=5)
    assert not alive
    with sqlite3.connect(data / "hearth.db") as db:
        assert ("unload",) in db.execute("select event from residency_events").fetchall()
