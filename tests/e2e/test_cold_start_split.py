"""Cold starts taken apart on the real embedded GGUF: a hearth runner started by the residency manager reports
its load's phases, they fit inside what a client's stopwatch saw, the first request adds its prefill, and the
weights' source and the Warmer's cold/warm choice follow the file's real page-cache residency."""

import shutil
import time

import httpx
import pytest

from app.residency.manager import ModelSpec, ResidencyManager, weights_files
from app.residency.pagecache import Warmer, cached_fraction, drop
from app.residency.runner_spec import RunnerSpec
from app.residency.supervisor import runner_headers

pytestmark = pytest.mark.model


def test_a_loads_phases_add_up_within_the_clients_stopwatch_and_weights_follow_their_choice(gemma_path, tmp_path):
    # A copy of its own: dropping the shared file's pages would slow every other test's runner.
    path = str(shutil.copy(gemma_path, tmp_path / "gemma.gguf"))
    choice = {"weights": "cold"}

    def specs():
        runner = RunnerSpec("gemma", path, n_ctx=1024, parallel=1, threads=2, cache_ram_mib=0)
        return {"gemma": ModelSpec("gemma", path, 1 << 30, runner=runner, weights=choice["weights"])}

    events, completed = [], []
    holder = []
    warmer = Warmer(lambda: weights_files(specs()), lambda: {m["name"] for m in holder[0].status()
                                                             if m["state"] in ("loading", "ready")})
    manager = ResidencyManager(specs, lambda: 1 << 40, events.append, on_first_use=completed.append,
                               on_stopped=warmer.stopped)
    holder.append(manager)
    try:
        drop(path)
        assert cached_fraction(path) < 0.1
        t0 = time.monotonic()
        manager.load("gemma")
        load_ms = (time.monotonic() - t0) * 1000
        load = next(e for e in events if e.event == "load")
        assert load.weights_source == "disk"
        assert load.load_read_ms > 0 and load.load_context_ms > 0
        assert load.load_upload_ms is None  # no GPU layers: nothing uploaded
        assert load.first_prefill_ms is None  # no request yet
        assert load.load_read_ms + load.load_context_ms <= load.cold_start_ms <= load_ms

        prompt = "The household's voice assistant turns the kitchen lights on when asked. " * 8
        t0 = time.monotonic()
        with manager.acquire("gemma") as lease:
            r = httpx.post(f"{lease.url}/completion", json={"prompt": prompt, "n_predict": 4},
                           headers=runner_headers(lease.url), timeout=120)
            assert r.status_code == 200, r.text
        request_ms = (time.monotonic() - t0) * 1000
        assert len(completed) == 1
        first = completed[0]
        assert first.pid == load.pid and first.kv_source == "none" and first.load_restore_ms == 0
        assert first.load_read_ms == load.load_read_ms  # the same load, completed
        assert 0 < first.first_prefill_ms <= request_ms
        assert first.cold_start_ms + first.load_restore_ms + first.first_prefill_ms <= load_ms + request_ms

        # Cold: once the runner has exited, its pages are dropped.
        read_in = cached_fraction(path)
        assert read_in > 0.5  # the runner read its weights
        assert manager.unload("gemma")
        assert cached_fraction(path) < 0.1

        # Warm: after the next stop the Warmer reads it back, and the load after that reads memory.
        choice["weights"] = "warm"
        manager.load("gemma")
        drop(path)  # what the kernel might do under pressure while it runs (mapped pages stay)
        assert manager.unload("gemma")
        assert warmer.idle(60)
        assert cached_fraction(path) > 0.99
        events.clear()
        manager.load("gemma")
        assert next(e for e in events if e.event == "load").weights_source == "page_cache"
    finally:
        manager.shutdown()
        warmer.close()
