"""The preload job through a real residency manager, a real runner on the Gemma GGUF and a real store:
it loads at the scheduled minute with the schedule as the event's reason, and a model serving requests is
never evicted for a preload (the manager's refusal stands)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from functools import partial

import httpx
from sqlalchemy import select

from app.residency.manager import ModelSpec, ModelState, ResidencyManager
from app.residency.runner_spec import RunnerSpec
from app.residency.supervisor import runner_headers
from app.services.preload import Preloader
from app.services.records import record_residency_event
from app.store.models import PreloadEntry, ResidencyEvent
from app.store.writer import StoreWriter

MiB = 2**20
TZ = timezone(timedelta(hours=2))


class Clock:
    def __init__(self, t: datetime):
        self.t = t

    def __call__(self):
        return self.t


def _spec(name: str, path) -> ModelSpec:
    runner = RunnerSpec(model_name=name, model_path=str(path), n_ctx=512, parallel=2, threads=2)
    return ModelSpec(name=name, path=str(path), estimate_bytes=300 * MiB, runner=runner)


def test_preload_loads_through_the_manager_and_never_evicts_a_busy_model(engine, sessions, gemma_path):
    with sessions() as s:
        s.add_all([
            PreloadEntry(model_name="voice", days="daily", at_minute=375, window_start_minute=390, window_end_minute=420,
                         evidence="test", applied_by="admin"),
            PreloadEntry(model_name="chat", days="daily", at_minute=376, window_start_minute=390, window_end_minute=420,
                         evidence="test", applied_by="admin")])
        s.commit()
    writer = StoreWriter(engine)
    writer.start()
    catalog = {"voice": _spec("voice", gemma_path), "chat": _spec("chat", gemma_path)}
    # Room for one of the two.
    manager = ResidencyManager(lambda: catalog, lambda: 400 * MiB, partial(record_residency_event, writer))
    clock = Clock(datetime(2026, 12, 1, 6, 14, tzinfo=TZ))
    job = Preloader(sessions, manager, clock=clock, tz=TZ)
    try:
        assert job.run() == []
        clock.t += timedelta(minutes=1)
        [loaded] = job.run()
        assert loaded.result == "loaded"
        voice = next(m for m in manager.status() if m["name"] == "voice")
        # Held 15 minutes to the window plus its own 300 s keep-alive.
        assert voice["state"] == ModelState.READY and voice["client_keep_alive_s"] == 1200
        # voice now serves a request (a lease held): chat's preload at 06:16 would have to evict it.
        with manager.acquire("voice") as lease:
            r = httpx.post(f"{lease.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0},
                           headers=runner_headers(lease.url), timeout=60)
            assert r.status_code == 200
            clock.t += timedelta(minutes=1)
            [refused] = job.run()
        assert refused.result == "refused" and "cannot evict voice (busy: 1 in flight)" in refused.detail
        states = {m["name"]: m["state"] for m in manager.status()}
        assert states == {"voice": ModelState.READY, "chat": ModelState.UNLOADED}
        assert writer.flush(10)
        with sessions() as s:
            rows = s.execute(select(ResidencyEvent.model_name, ResidencyEvent.event, ResidencyEvent.reason)
                             .order_by(ResidencyEvent.id)).all()
        assert rows == [("voice", "load", "preload schedule 06:15")]
    finally:
        manager.shutdown()
        writer.stop(10)
