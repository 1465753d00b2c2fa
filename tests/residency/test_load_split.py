"""A load's split as serve reads it from a runner's load_timings, and as the store records and completes it."""

from __future__ import annotations

import dataclasses

from sqlalchemy import select

from app.residency.manager import ResidencyEvent
from app.residency.supervisor import LoadSplit
from app.services.records import complete_load_event, record_residency_event
from app.store import models as db
from app.store.writer import StoreWriter


def test_a_hearth_runners_timings_become_the_events_columns():
    split = LoadSplit.from_timings({"read_ms": 812.5, "upload_ms": None, "context_ms": 64, "engine_ms": 300,
                                    "load_ms": 1177.5}, weights_cached=0.97)
    assert split.measured_by_runner and split.weights_source == "page_cache"
    assert split.event_fields() == {"load_read_ms": 812.5, "load_context_ms": 64.0, "load_upload_ms": None,
                                    "load_restore_ms": None, "first_prefill_ms": None,
                                    "weights_source": "page_cache", "kv_source": None}


def test_a_stock_llama_server_tells_nothing_but_the_weights_source_is_still_judged():
    split = LoadSplit.from_timings(None, weights_cached=0.12)
    assert not split.measured_by_runner and split.weights_source == "disk"
    assert {k for k, v in split.event_fields().items() if v is not None} == {"weights_source"}
    assert LoadSplit.from_timings(None, None).weights_source is None  # mincore unavailable: unknown


def test_values_a_runner_should_not_send_are_left_out_not_trusted():
    split = LoadSplit.from_timings({"read_ms": -5, "context_ms": "fast", "first_prefill_ms": True,
                                    "restore_ms": 12, "kv_source": "tape"}, weights_cached=0.0)
    assert (split.read_ms, split.context_ms, split.first_prefill_ms, split.restore_ms) == (None, None, None, 12.0)
    assert split.kv_source is None


def test_the_first_request_completes_the_loads_own_row(engine, sessions):
    writer = StoreWriter(engine)
    writer.start()
    try:
        load = ResidencyEvent("gemma", "load", "first request", node="local", cold_start_ms=2400.0, pid=41,
                              load_read_ms=900.0, load_context_ms=70.0, weights_source="disk")
        older = dataclasses.replace(load, pid=40, at=load.at - 60)
        record_residency_event(writer, older)
        record_residency_event(writer, load)
        complete_load_event(writer, dataclasses.replace(load, first_prefill_ms=350.0, load_restore_ms=0.0,
                                                        kv_source="none"))
        assert writer.flush(10)
    finally:
        writer.stop(10)
    with sessions() as s:
        rows = {r.pid: r for r in s.scalars(select(db.ResidencyEvent))}
    assert (rows[41].first_prefill_ms, rows[41].load_restore_ms, rows[41].kv_source) == (350.0, 0.0, "none")
    assert (rows[41].load_read_ms, rows[41].weights_source, rows[41].cold_start_ms) == (900.0, "disk", 2400.0)
    assert rows[40].first_prefill_ms is None  # another runner's load is left as it was
