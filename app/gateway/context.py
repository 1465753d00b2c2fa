"""The services one `hearth serve` process holds, typed, and the one accessor the gateway and web use.

`build_services` wires them; the factory installs them on the app; request handlers call
`services()`. Each service has one job: the catalog names models, the router leases them (and maps
errors to HTTP), the recorder logs requests, the settings cache spares SQLite, the sampler and
rollups are the telemetry jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

from flask import Flask, current_app
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

from app.gateway.admission import Admission
from app.gateway.auth import TokenCache
from app.gateway.classes import ClassRegistry
from app.gateway.routing import Router
from app.gateway.tokens import principal_loader
from app.residency.library import Library
from app.residency.manager import ResidencyManager
from app.services.catalog import Catalog, pull_refusal
from app.services.records import Recorder, record_residency_event
from app.services.settings import SettingsCache, budget_bytes
from app.store.writer import StoreWriter
from app.telemetry.metrics import GatewayMetrics
from app.telemetry.rollup import Rollups
from app.telemetry.sampler import Sampler

_EXTENSION = "hearth"


@dataclass(frozen=True)
class Services:
    """Everything the gateway, the scheduled jobs and the dashboard share."""

    data_dir: Path
    sessions: sessionmaker
    writer: StoreWriter
    settings: SettingsCache
    catalog: Catalog
    residency: ResidencyManager
    router: Router
    recorder: Recorder
    admission: Admission
    classes: ClassRegistry
    tokens: TokenCache
    sampler: Sampler
    rollups: Rollups
    metrics: GatewayMetrics
    library: Library

    def shutdown(self) -> None:
        """Stop every runner, then flush the store."""
        self.residency.shutdown()
        self.writer.stop(timeout_s=10)


def build_services(data_dir: Path, engine: Engine, sessions: sessionmaker, default_model: Path | None,
                   models_dir_override: str | None = None) -> Services:
    """Start the store writer and wire every service over the store (the catalog is scanned once)."""
    writer = StoreWriter(engine)
    writer.start()
    settings = SettingsCache(sessions)
    catalog = Catalog.open(data_dir, sessions, settings, default_model, models_dir_override)
    admission = Admission(max_in_flight_total=int(settings.get("max_in_flight_total")))
    residency = ResidencyManager(catalog.model_specs, partial(budget_bytes, settings),
                                 partial(record_residency_event, writer))
    sampler = Sampler(writer, residency.status, admission.snapshot)
    metrics = GatewayMetrics(residency.status, admission.snapshot, sampler, writer.health)
    return Services(
        data_dir=data_dir, sessions=sessions, writer=writer, settings=settings, catalog=catalog,
        residency=residency, router=Router(catalog, residency), recorder=Recorder(writer, metrics),
        admission=admission, classes=ClassRegistry(sessions), tokens=TokenCache(principal_loader(sessions)),
        sampler=sampler, rollups=Rollups(writer), metrics=metrics,
        library=Library(catalog.models_dir, partial(pull_refusal, settings), lambda path: catalog.rescan(),
                        endpoint=lambda: settings.get("hf_endpoint")),
    )


def install(app: Flask, svc: Services) -> None:
    """Make `svc` the services of `app`."""
    app.extensions[_EXTENSION] = svc


def services(app: Flask | None = None) -> Services:
    """The services of `app`, by default of the app handling the current request."""
    return (app or current_app).extensions[_EXTENSION]
