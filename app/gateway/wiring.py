"""The serve wiring: `build_services` starts the store writer and builds every service of one `hearth serve`."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import sessionmaker

from app.gateway.admission import Admission
from app.gateway.auth import TokenCache
from app.gateway.classes import ClassRegistry
from app.gateway.context import Services
from app.gateway.cores import CoreShare, send_hold
from app.gateway.lan import ProxyWatch
from app.gateway.members import DAY_S, Usage
from app.gateway.people import People
from app.gateway.refusals import Refusals
from app.gateway.routing import Router
from app.gateway.tokens import principal_loader
from app.residency.library import Library
from app.residency.manager import RESIDENT_STATES, ResidencyManager, weights_files
from app.residency.pagecache import Warmer
from app.services.catalog import Catalog, pull_refusal
from app.services.preload import Preloader
from app.services.records import Recorder, complete_load_event, record_residency_event
from app.services.settings import SettingsCache, budget_bytes, device_budget_bytes, offload_devices
from app.services.targets import TargetSizer
from app.speech.client import Speech
from app.store.db import writing_sessions
from app.store.models import RequestRecord, utcnow
from app.store.writer import StoreWriter
from app.telemetry.metrics import GatewayMetrics
from app.telemetry.rollup import Rollups
from app.telemetry.sampler import Sampler
from app.telemetry.stream_cost import StreamCost, StreamCostCollector, counter_total


def seeded_usage(sessions: sessionmaker) -> Usage:
    """The members' rate windows, with the last 24 hours of the request log in them (so a restart hands out no
    fresh day)."""
    usage = Usage()
    since = utcnow() - timedelta(seconds=DAY_S)
    minute = func.strftime("%Y-%m-%d %H:%M", RequestRecord.arrival_at)
    with sessions() as s:
        rows = s.execute(
            select(RequestRecord.member_name, minute, func.count(),
                   func.sum(func.coalesce(RequestRecord.prompt_tokens, 0)
                            + func.coalesce(RequestRecord.completion_tokens, 0)))
            .where(RequestRecord.arrival_at >= since, RequestRecord.member_name.is_not(None))
            .group_by(RequestRecord.member_name, minute).order_by(minute)).all()
    usage.seed((member, _minute_s(at), int(n), int(tokens or 0)) for member, at, n, tokens in rows)
    return usage


def _minute_s(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M").replace(tzinfo=UTC).timestamp()


def build_services(data_dir: Path, engine: Engine, sessions: sessionmaker, default_model: Path | None,
                   models_dir_override: str | None = None) -> Services:
    """Start the store writer and wire every service over the store (the catalog is scanned once)."""
    writer = StoreWriter(engine)
    writer.start()
    settings = SettingsCache(sessions)
    # The fit reads the devices the runners' build offloads to (none with the default CPU build: no probe runs).
    catalog = Catalog.open(data_dir, sessions, settings, default_model, models_dir_override,
                           devices=lambda: list(offload_devices()))
    admission = Admission(max_in_flight_total=int(settings.get("max_in_flight_total")))
    # The warmer asks the residency manager what is up; the manager tells the warmer what stopped.
    # The voices the TTS process holds count in the models' RAM budget: what they take, a model cannot.
    speech = Speech(lambda: catalog.models_dir, lambda: settings.get("tts_threads"),
                    lambda: float(settings.get("tts_keep_alive_s")))
    holder: list[ResidencyManager] = []
    warmer = Warmer(lambda: weights_files(catalog.model_specs()),
                    lambda: {m["name"] for m in holder[0].status() if m["state"] in RESIDENT_STATES})
    residency = ResidencyManager(catalog.model_specs, lambda: budget_bytes(settings) - speech.resident_bytes(),
                                 partial(record_residency_event, writer),
                                 busy_wait_s=lambda: float(settings.get("model_swap_wait_s")),
                                 on_first_use=partial(complete_load_event, writer), on_stopped=warmer.stopped,
                                 device_budgets=partial(device_budget_bytes, settings))
    holder.append(residency)
    sampler = Sampler(writer, residency.status, admission.snapshot)
    metrics = GatewayMetrics(residency.status, admission.snapshot, sampler, writer.health, residency.device_status)
    # What a stream costs serve and its runners in CPU per 1,000 tokens: sampled with the telemetry, read by the
    # Overview and /metrics.
    sampler.stream_cost = StreamCost(partial(counter_total, metrics.completion_tokens))
    metrics.registry.register(StreamCostCollector(sampler.stream_cost))
    tokens = TokenCache(principal_loader(sessions))
    classes = ClassRegistry(sessions)

    def slots_of(model: str) -> int | None:
        spec = catalog.model_specs().get(model)
        return spec.runner.parallel if spec is not None and spec.runner is not None else None

    write_sessions = writing_sessions(engine)
    targets = TargetSizer(write_sessions, settings, lambda: sampler.latest, catalog.default_model_name, slots_of,
                          classes.invalidate)
    return Services(
        data_dir=data_dir, sessions=sessions, write_sessions=write_sessions, writer=writer, settings=settings, catalog=catalog,
        residency=residency, router=Router(catalog, residency), recorder=Recorder(writer, metrics),
        admission=admission, classes=classes, tokens=tokens,
        sampler=sampler, rollups=Rollups(writer), metrics=metrics,
        library=Library(catalog.models_dir, partial(pull_refusal, settings), lambda path: catalog.rescan(),
                        endpoint=lambda: settings.get("hf_endpoint"), name_problem=catalog.pull_name_problem),
        refusals=Refusals(writer, metrics.observe), usage=seeded_usage(sessions), people=People(sessions, writer),
        proxy_watch=ProxyWatch(), targets=targets, warmer=warmer,
        preload=Preloader(sessions, residency),
        speech=speech,
        cores=CoreShare(send_hold, lambda: bool(settings.get("runner_core_yield"))),
    )
