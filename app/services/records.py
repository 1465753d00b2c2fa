"""Request and residency records: counted for /metrics and queued on the single store writer."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from sqlalchemy import select

from app.residency.manager import ResidencyEvent
from app.store import models as db
from app.store.writer import StoreWriter
from app.telemetry.metrics import GatewayMetrics

log = logging.getLogger(__name__)


class Recorder:
    """The request log: one row per finished, failed or refused request."""

    def __init__(self, writer: StoreWriter, metrics: GatewayMetrics):
        self._writer = writer
        self._metrics = metrics

    def record_request(self, record: dict, **fields) -> None:
        """Queue one finished, failed or refused request for the store (never blocks serving)."""
        values = {**record, **{k: v for k, v in fields.items() if v is not None}}
        values.setdefault("num_preemptions", 0)
        self._metrics.observe(values)
        self._writer.add(db.RequestRecord(**values))


def record_residency_event(writer: StoreWriter, ev: ResidencyEvent) -> None:
    """Log a residency event and queue it for the store (the residency manager's on_event)."""
    log.info("residency: %s %s (%s)", ev.event, ev.model_name, ev.reason)
    writer.add(db.ResidencyEvent(
        at=datetime.fromtimestamp(ev.at, UTC), model_name=ev.model_name, node=ev.node,
        event=ev.event, reason=ev.reason, cold_start_ms=ev.cold_start_ms, estimate_bytes=ev.estimate_bytes,
        measured_bytes=ev.measured_bytes, pid=ev.pid, **_split(ev),
    ))


def _split(ev: ResidencyEvent) -> dict:
    return {"load_read_ms": ev.load_read_ms, "load_context_ms": ev.load_context_ms,
            "load_upload_ms": ev.load_upload_ms, "load_restore_ms": ev.load_restore_ms,
            "first_prefill_ms": ev.first_prefill_ms, "weights_source": ev.weights_source, "kv_source": ev.kv_source}


def complete_load_event(writer: StoreWriter, ev: ResidencyEvent) -> None:
    """Queue the update of a load's row with its first request's parts (the residency manager's on_first_use).

    The row is the model's latest load by the same runner pid: queued after the load's insert on the one
    writer, so it is there when this runs."""
    split = _split(ev)

    def work(session) -> None:
        row = session.scalar(select(db.ResidencyEvent)
                             .where(db.ResidencyEvent.model_name == ev.model_name, db.ResidencyEvent.event == "load",
                                    db.ResidencyEvent.pid == ev.pid)
                             .order_by(db.ResidencyEvent.id.desc()).limit(1))
        if row is not None:
            for name, value in split.items():
                setattr(row, name, value)

    writer.submit(work)
