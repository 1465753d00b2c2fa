"""The services one `hearth serve` process holds, wired together: store, catalog, residency, gateway state."""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import sessionmaker

from app.engine.api import ApiError
from app.gateway.admission import Admission
from app.gateway.auth import TokenCache
from app.gateway.classes import ClassRegistry
from app.gateway.tokens import principal_loader
from app.policy import ClassPolicy
from app.residency.budget import detect_budget
from app.residency.catalog import CatalogEntry, scan
from app.residency.default_model import BackgroundAssembly
from app.residency.estimate import estimate_memory
from app.residency.manager import (
    Lease,
    ModelLoadFailed,
    ModelSpec,
    NotEnoughMemory,
    ResidencyEvent,
    ResidencyManager,
    UnknownModel,
)
from app.residency.supervisor import RunnerSpec
from app.store import models as db
from app.store.settings import get_setting
from app.store.writer import StoreWriter
from app.telemetry.metrics import GatewayMetrics

log = logging.getLogger(__name__)

MIB = 1024 * 1024
SETTINGS_TTL_S = 5.0


def record_catalog(session, entries: list[CatalogEntry], now: datetime) -> list[db.Model]:
    """Upsert one `models` row per catalog entry (the admin's policy, keep-alive and alias are kept)."""
    rows = []
    for e in entries:
        row = session.scalar(select(db.Model).where(db.Model.name == e.name))
        if row is None:
            row = db.Model(name=e.name, first_seen_at=now)
            session.add(row)
        row.path, row.source, row.size_bytes = str(e.path), e.source, e.size_bytes
        row.architecture, row.n_params, row.quantization = e.architecture, e.n_params, e.quantization
        row.n_ctx_train, row.n_layers, row.n_head_kv = e.n_ctx_train, e.n_layers, e.n_head_kv
        row.head_dim_k, row.head_dim_v = e.head_dim_k, e.head_dim_v
        row.has_chat_template, row.usable, row.unusable_reason = e.has_chat_template, e.usable, e.unusable_reason
        row.last_seen_at = now
        rows.append(row)
    session.flush()
    return rows


def _assembling_error(progress: dict) -> ApiError:
    """The 503 for a request that needs the default model while it is assembled (or failed to be)."""
    if progress["error"]:
        return ApiError(503, f"the default model could not be assembled: {progress['error']}",
                        code="default_model_failed", err_type="unavailable_error", headers={"Retry-After": "60"})
    being = "assembled" if progress["phase"] == "assembling" else "verified"
    return ApiError(503, f"the default model is being {being} ({progress['percent']} %); retry in a few seconds",
                    code="default_model_assembling", err_type="unavailable_error", headers={"Retry-After": "5"})


class Hearth:
    """Everything the gateway, the jobs and the dashboard share."""

    def __init__(self, data_dir: Path, models_dir: Path | None, default_model: Path | None,
                 engine, sessions: sessionmaker):
        self.data_dir = data_dir
        self.models_dir = models_dir
        self.default_model = default_model
        # Set while the embedded default model is assembled in the background (first run).
        self.default_model_assembly: BackgroundAssembly | None = None
        self.engine = engine
        self.sessions = sessions
        self.writer = StoreWriter(engine)
        self.writer.start()
        self.classes = ClassRegistry(sessions)
        self.tokens = TokenCache(principal_loader(sessions))
        with sessions() as s:
            self.admission = Admission(max_in_flight_total=int(get_setting(s, "max_in_flight_total")))
        self._settings_cache: dict[str, tuple[float, object]] = {}
        self._catalog_lock = threading.Lock()
        self.catalog: list[CatalogEntry] = []
        self._specs: dict[str, ModelSpec] = {}
        self._aliases: dict[str, str] = {}
        self.residency = ResidencyManager(self.model_specs, self.budget_bytes, self.on_residency_event)
        self.metrics = GatewayMetrics(self)
        self.rescan()

    # -- catalog ---------------------------------------------------------------------------------

    def rescan(self) -> list[CatalogEntry]:
        """Rescan the models folder; record every model in the store; rebuild what can be served."""
        with self._catalog_lock:
            entries = scan(self.models_dir, self.default_model, previous=self.catalog)
            now = datetime.now(UTC)
            specs: dict[str, ModelSpec] = {}
            aliases: dict[str, str] = {}
            with self.sessions() as s:
                defaults = {k: get_setting(s, f"runner_{k}") for k in ("ctx", "parallel", "batch", "threads", "prefix_cache")}
                for e, row in zip(entries, record_catalog(s, entries, now)):
                    if not e.usable:
                        continue
                    rs = s.scalar(select(db.RunnerSettings).where(db.RunnerSettings.model_id == row.id))
                    spec = RunnerSpec(
                        model_name=e.name,
                        model_path=str(e.path),
                        kind=(rs.kind if rs else "hearth"),
                        binary_path=rs.binary_path if rs else None,
                        n_ctx=(rs and rs.n_ctx) or int(defaults["ctx"]),
                        parallel=(rs and rs.parallel) or int(defaults["parallel"]),
                        n_batch=(rs and rs.n_batch) or int(defaults["batch"]),
                        threads=(rs and rs.threads) or int(defaults["threads"] or os.cpu_count() or 1),
                        gpu_layers=(rs and rs.gpu_layers) or 0,
                        mode=(rs and rs.mode) or "continuous",
                        prefix_cache=bool(defaults["prefix_cache"]),
                    )
                    estimate = estimate_memory(e, spec.n_ctx, spec.parallel, spec.n_batch)
                    nodes = s.scalars(select(db.Node).where(db.Node.model_id == row.id, db.Node.enabled)).all()
                    specs[e.name] = ModelSpec(
                        name=e.name, path=str(e.path), estimate_bytes=estimate.total_bytes, policy=row.policy,
                        keep_alive_s=row.keep_alive_s, runner=spec,
                        remote=tuple((n.url, n.label or n.url) for n in nodes),
                    )
                    if row.alias:
                        aliases[row.alias] = e.name
                s.commit()
            self.catalog = entries
            self._specs = specs
            self._aliases = aliases
            return entries

    def assemble_default_model(self) -> None:
        """Assemble the embedded default model in the background; once ready, list it and start pinned models."""
        self.default_model_assembly = BackgroundAssembly(self.data_dir, self._default_model_ready,
                                                         after_ready=self._start_pinned)
        self.default_model_assembly.start()

    def _default_model_ready(self, path: Path) -> None:
        self.default_model = path
        self.rescan()

    def _start_pinned(self) -> None:
        started = self.residency.start_pinned()
        if started:
            log.info("pinned models: %s", started)

    def default_model_progress(self) -> dict | None:
        """How far the background assembly of the default model is (phase, bytes, percent, error); None when ready."""
        assembly = self.default_model_assembly
        return None if assembly is None else assembly.progress()

    def model_specs(self) -> dict[str, ModelSpec]:
        """Servable models by name (cheap: rebuilt only on rescan)."""
        return self._specs

    def setting(self, name: str):
        """A stored setting, cached for SETTINGS_TTL_S so the request path never waits on SQLite."""
        now = time.monotonic()
        hit = self._settings_cache.get(name)
        if hit is not None and now - hit[0] < SETTINGS_TTL_S:
            return hit[1]
        with self.sessions() as s:
            value = get_setting(s, name)
        self._settings_cache[name] = (now, value)
        return value

    def budget_bytes(self) -> int:
        """Memory resident models may use."""
        limit = self.setting("memory_limit_mb")
        reserve = self.setting("memory_reserve_mb")
        budget = detect_budget(
            reserve_bytes=None if reserve is None else int(reserve) * MIB,
            limit_bytes=None if limit is None else int(limit) * MIB,
        )
        return budget.usable_bytes

    def default_model_name(self) -> str | None:
        """The model a request gets when neither it nor its class names one."""
        configured = self.setting("default_model")
        if configured:
            return configured
        if self.default_model_progress() is not None:
            return self.default_model_assembly.model_name
        defaults = [e.name for e in self.catalog if e.source == "default" and e.usable]
        return defaults[0] if defaults else next(iter(self._specs), None)

    def resolve_model(self, requested: str | None, policy: ClassPolicy) -> str:
        """The catalog name for a request's model (aliases, class default, household default); 404 if unknown."""
        name = requested or policy.default_model or self.default_model_name()
        if name in ("default", None, ""):
            name = self.default_model_name()
        name = self._aliases.get(name, name)
        progress = self.default_model_progress()
        if progress is not None and name == progress["model"]:
            raise _assembling_error(progress)
        if name not in self._specs:
            known = sorted(set(self._specs) | set(self._aliases))
            unusable = {e.name: e.unusable_reason for e in self.catalog if not e.usable}
            if name in unusable:
                raise ApiError(404, f"model '{name}' cannot be served: {unusable[name]}", param="model",
                               code="model_unusable")
            raise ApiError(404, f"unknown model '{name}'; available: {', '.join(known) or 'none'}",
                           param="model", code="model_not_found")
        return name

    def acquire_model(self, name: str) -> Lease:
        """A lease on a node serving the model; residency errors become clear HTTP errors."""
        try:
            return self.residency.acquire(name)
        except UnknownModel:
            raise ApiError(404, f"unknown model '{name}'", param="model", code="model_not_found")
        except ModelLoadFailed as exc:
            raise ApiError(503, f"model '{name}' could not be loaded: {exc.reason}", code="model_load_failed",
                           err_type="unavailable_error", headers={"Retry-After": "10"})
        except NotEnoughMemory as exc:
            raise ApiError(503, str(exc), code="not_enough_memory", err_type="unavailable_error",
                           headers={"Retry-After": "30"})

    def model_list(self) -> list[dict]:
        """/v1/models: servable models with their state, plus aliases."""
        states = {m["name"]: m for m in self.residency.status()}
        out = []
        for name, spec in self._specs.items():
            st = states.get(name, {})
            out.append({"id": name, "object": "model", "created": 0, "owned_by": "hearth",
                        "hearth": {"state": st.get("state", "unloaded"), "policy": spec.policy,
                                   "estimate_bytes": spec.estimate_bytes,
                                   "aliases": sorted(a for a, n in self._aliases.items() if n == name)}})
        for alias, name in sorted(self._aliases.items()):
            out.append({"id": alias, "object": "model", "created": 0, "owned_by": "hearth",
                        "hearth": {"alias_of": name}})
        return out

    # -- records -----------------------------------------------------------------------------------

    def record_request(self, record: dict, **fields) -> None:
        """Queue one finished, failed or refused request for the store (never blocks serving)."""
        values = {**record, **{k: v for k, v in fields.items() if v is not None}}
        values.setdefault("num_preemptions", 0)
        self.metrics.observe(values)
        self.writer.add(db.RequestRecord(**values))

    def on_residency_event(self, ev: ResidencyEvent) -> None:
        """Store a residency event and log it."""
        log.info("residency: %s %s (%s)", ev.event, ev.model_name, ev.reason)
        self.writer.add(db.ResidencyEvent(
            at=datetime.fromtimestamp(ev.at, UTC), model_name=ev.model_name, node=ev.node,
            event=ev.event, reason=ev.reason, cold_start_ms=ev.cold_start_ms, estimate_bytes=ev.estimate_bytes,
            measured_bytes=ev.measured_bytes, pid=ev.pid,
        ))

    def telemetry_health(self) -> dict:
        """The store writer's health for the dashboard: telemetry lost by reason, last error, failing now."""
        return self.writer.health()

    def shutdown(self) -> None:
        """Stop every runner, then flush the store."""
        self.residency.shutdown()
        self.writer.stop(timeout_s=10)
