"""The services one `hearth serve` process holds, typed, and the one accessor the gateway and web use.

`app.gateway.wiring.build_services` wires them; the factory installs them on the app; request handlers
call `services()`. Each service has one job: the catalog names models, the router leases them (and maps
errors to HTTP), the recorder logs requests, the refusals count the requests refused at admission,
usage keeps the members' rate windows, people names the persons behind trusted tokens, the proxy
watch guards LAN-open mode, the settings cache spares SQLite, the sampler and rollups are the
telemetry jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flask import Flask, current_app
from sqlalchemy.orm import sessionmaker

from app.gateway.admission import Admission
from app.gateway.auth import TokenCache
from app.gateway.classes import ClassRegistry
from app.gateway.cores import CoreShare
from app.gateway.lan import ProxyWatch
from app.gateway.members import Usage
from app.gateway.people import People
from app.gateway.refusals import Refusals
from app.gateway.routing import Router
from app.residency.library import Library
from app.residency.manager import ResidencyManager
from app.residency.pagecache import Warmer
from app.services.catalog import Catalog
from app.services.preload import Preloader
from app.services.records import Recorder
from app.services.settings import SettingsCache
from app.services.targets import TargetSizer
from app.speech.client import Speech
from app.store.writer import StoreWriter
from app.telemetry.metrics import GatewayMetrics
from app.telemetry.rollup import Rollups
from app.telemetry.sampler import Sampler

_EXTENSION = "hearth"


@dataclass(frozen=True)
class Services:
    """Everything the gateway, the scheduled jobs and the dashboard share."""

    data_dir: Path
    # Plain sessions for reading; `write_sessions` for a unit of work that reads, then writes (it takes the write lock
    # at BEGIN, so serve's store writer committing in between cannot make SQLite refuse the write).
    sessions: sessionmaker
    write_sessions: sessionmaker
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
    refusals: Refusals
    usage: Usage
    people: People
    proxy_watch: ProxyWatch
    targets: TargetSizer
    preload: Preloader
    # Keeps stopped models' weights in the page cache by their choice (None: nothing is warmed).
    warmer: Warmer | None = None
    # Speech out: the Piper voices and the TTS process (None: a test's services without it).
    speech: Speech | None = None
    # The local runners' CPU, yielded to the most urgent request's (app.gateway.cores; None: a test's services).
    cores: CoreShare | None = None

    def shutdown(self) -> None:
        """Stop every runner and the TTS process, then flush the refusal counts and the store."""
        self.residency.shutdown()
        if self.speech is not None:
            self.speech.stop()
        if self.warmer is not None:
            self.warmer.close()
        self.refusals.flush()
        self.writer.stop(timeout_s=10)

    def forget_members(self) -> None:
        """Read tokens, members and people afresh (after an edit made in this process: a revocation, limits)."""
        self.tokens.clear()
        self.people.clear()


def install(app: Flask, svc: Services) -> None:
    """Make `svc` the services of `app`."""
    app.extensions[_EXTENSION] = svc


def services(app: Flask | None = None) -> Services:
    """The services of `app`, by default of the app handling the current request."""
    return (app or current_app).extensions[_EXTENSION]
