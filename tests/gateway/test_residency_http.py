"""Residency through `hearth serve`: eviction under a budget that fits one model, and no runner outlives serve."""

import os
import signal

import psutil

from app.engine.kv_tiers import DEFAULT_CACHE_RAM_MIB
from app.residency.catalog import scan
from app.residency.estimate import estimate_memory
from tests.helpers import SMALL_RUNNERS, query, wait_until


def test_budget_that_fits_one_model_evicts_the_idle_one(start_serve, gemma_path, models_dir):
    # The RAM tier at its default budget is part of each runner's footprint.
    one = estimate_memory(scan(None, gemma_path)[0], 512, 2, ram_tier_mib=DEFAULT_CACHE_RAM_MIB).total_bytes
    s = start_serve(models_dir, settings={**SMALL_RUNNERS, "memory_limit_mb": int(one * 1.5 / 2**20)})
    hdr = {"Authorization": f"Bearer {s.tokens['alice']}"}
    for model in ("gemma-3-270m-q4_k_m", "gemma-b", "gemma-3-270m-q4_k_m"):
        r = s.client.post("/v1/completions", headers=hdr, json={"model": model, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert len(s.runner_arbiters()) == 1
    expected = [("gemma-3-270m-q4_k_m", "load"), ("gemma-3-270m-q4_k_m", "evict"), ("gemma-b", "load"),
                ("gemma-b", "evict"), ("gemma-3-270m-q4_k_m", "load")]

    def all_five():
        events = query(s.data / "hearth.db", "select model_name, event, cold_start_ms from residency_events order by id")
        return events if len(events) >= len(expected) else None

    events = wait_until(all_five, 10, "the five residency events were never all recorded")
    assert [(m, e) for m, e, _ in events] == expected
    assert all(ms > 0 for _, e, ms in events if e == "load")


def test_runners_do_not_outlive_a_killed_serve(start_serve, models_dir):
    s = start_serve(models_dir)
    r = s.client.post("/v1/completions", headers={"Authorization": f"Bearer {s.tokens['alice']}"},
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


def test_sigterm_stops_runners_cleanly(start_serve, models_dir):
    s = start_serve(models_dir)
    s.client.post("/v1/completions", headers={"Authorization": f"Bearer {s.tokens['alice']}"},
                  json={"prompt": "Hi", "max_tokens": 2})
    runners = s.runner_processes()
    assert runners
    s.stop()
    assert s.proc.returncode == 0
    gone, alive = psutil.wait_procs(runners, timeout=5)
    assert not alive
    # Stopped: everything it wrote is committed.
    assert ("unload",) in query(s.data / "hearth.db", "select event from residency_events")
