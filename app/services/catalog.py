"""The model catalog as `hearth serve` and `hearth models list` see it: the models folder, each model's
runner spec and memory estimate (per-model runner settings over the stored defaults), aliases, and the
embedded default model while it is assembled. Names that cannot be served raise domain errors; the
gateway (app.gateway.routing) turns them into HTTP answers."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.device_probe import is_software_vulkan
from app.devices import Device
from app.engine.kv_types import DEFAULT_KV_TYPE
from app.gguf_meta import GgufError
from app.paths import KV_CACHE_DIR
from app.residency.budget import KIND_RAM, counted_bytes, counts_ram_tier
from app.residency.catalog import CatalogEntry, scan
from app.residency.default_model import BackgroundAssembly
from app.residency.estimate import MIB, MemoryEstimate, RunnerSizing, estimate_memory, size_runner, with_draft
from app.residency.fit import device_need, fit_runner
from app.residency.library import budget_refusal
from app.residency.manager import ModelSpec, ResidencyManager
from app.residency.pagecache import WEIGHTS_WARM
from app.residency.placement import CPU, model_tensors
from app.residency.runner_spec import DEFAULT_CACHE_DISK_MIB, DEFAULT_CACHE_RAM_MIB, RunnerSpec, parse_runner_args, spec_type_for
from app.services.privacy import MAX_AGE_SETTING, expire_kv_cache, remove_orphans
from app.services.settings import SettingsCache, flash_attn_possible, memory_budget
from app.store import models as db
from app.store.settings import get_setting

log = logging.getLogger(__name__)

RUNNER_DEFAULTS = ("ctx", "parallel", "batch", "threads", "prefix_cache", "args", "cache_ram_mib", "cache_disk_mib",
                   "cache_disk_max_age_h", "image_url_fetch", "image_url_hosts")  # the stored runner_* settings a spec falls back on


class ModelNotServable(Exception):
    """A request names a model the catalog cannot serve now."""

    def __init__(self, name: str | None, message: str):
        super().__init__(message)
        self.name = name


class ModelNotFound(ModelNotServable):
    """No model or alias of that name; `known` lists those there are."""

    def __init__(self, name: str | None, known: list[str]):
        super().__init__(name, f"unknown model '{name}'; available: {', '.join(known) or 'none'}")
        self.known = known


class ModelUnusable(ModelNotServable):
    """The file is in the models folder but cannot be served (`reason` says why)."""

    def __init__(self, name: str, reason: str | None):
        super().__init__(name, f"model '{name}' cannot be served: {reason}")
        self.reason = reason


class DefaultModelPending(ModelNotServable):
    """The embedded default model is still being assembled or verified, or its assembly failed."""

    def __init__(self, name: str, progress: dict):
        super().__init__(name, progress["error"] or f"the default model is being {progress['phase']}")
        self.progress = progress


class ModelEmbedded(ModelNotServable):
    """The embedded default model: it is Hearth's own, not a file of the models folder to delete."""

    def __init__(self, name: str):
        super().__init__(name, f"'{name}' is Hearth's embedded default model")


def pull_refusal(settings: SettingsCache, metadata) -> str | None:
    """Why a model being pulled (its header arrived) cannot be served or would not fit the budget; None if it can."""
    ctx, parallel, batch = (settings.get(f"runner_{k}") for k in ("ctx", "parallel", "batch"))
    memory = memory_budget(settings)
    # The hearth runner's RAM tier as the settings give it (a pulled model gets no runner_args yet).
    tier = _int_or(settings.get("runner_cache_ram_mib"), DEFAULT_CACHE_RAM_MIB) if settings.get("runner_prefix_cache") \
        is not False else 0
    return budget_refusal(metadata, ctx, parallel, int(batch), memory.usable_bytes,
                          ram_tier_mib=tier if counts_ram_tier(memory.kind) else 0)


# Names an alias can never take: what a request sends to mean the household's default model.
RESERVED_NAMES = ("default",)
MAX_ALIAS_CHARS = 255
OLLAMA_DEFAULT_TAG = ":latest"


def alias_problem(session: Session, alias: str, target: str) -> str | None:
    """Why `alias` cannot be another name of model `target`, or None: an alias never shadows a model's name or
    file name, nor another model's alias (so no alias can silently reroute the requests meant for a model)."""
    alias = alias.strip()
    bare = alias.removesuffix(OLLAMA_DEFAULT_TAG)
    if not bare:
        return "an alias cannot be empty"
    if len(alias) > MAX_ALIAS_CHARS:
        return f"an alias has at most {MAX_ALIAS_CHARS} characters"
    if bare.lower() in RESERVED_NAMES:
        return f"'{bare}' means the household's default model"
    if bare == target:
        return "it is the model's own name"
    for name, path, other in session.execute(select(db.Model.name, db.Model.path, db.Model.alias)):
        files = (Path(path).name, Path(path).stem) if path else ()
        if bare == name or bare in files or alias in files:
            return f"it is the name of the model '{name}'{f' ({files[0]})' if files else ''}: an alias never shadows a model"
        if other in (alias, bare) and name != target:
            return f"it is already an alias of '{name}'"
    return None


def resolve_models_dir(data_dir: Path, stored: str | None, override: str | None) -> Path:
    """The models folder: $HEARTH_MODELS_DIR (override) wins over the stored `models_dir`, then <data>/models."""
    return Path(override or stored or Path(data_dir) / "models").expanduser()


def record_catalog(session: Session, entries: list[CatalogEntry], now: datetime) -> list[db.Model]:
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


def runner_sizing(entry: CatalogEntry, rs: db.RunnerSettings | None, defaults: dict,
                  budget: int, budget_kind: str = KIND_RAM) -> RunnerSizing | None:
    """Slots and cells from the memory budget and the model where neither the model nor the defaults set them."""
    parallel = (rs and rs.parallel) or defaults.get("parallel")
    n_ctx = (rs and rs.n_ctx) or defaults.get("ctx")
    if parallel and n_ctx:
        return None
    n_batch = (rs and rs.n_batch) or int(defaults["batch"])
    gpu = bool(rs and rs.gpu_layers)
    # The draft rows the runner will reserve (speculation on) and its RAM tier count against the budget like the rest.
    plain = runner_spec(entry, rs, defaults)
    return size_runner(entry, budget, n_batch, gpu, int(parallel) if parallel else None,
                       int(n_ctx) if n_ctx else None, n_outputs_extra=plain.n_outputs_extra,
                       ram_tier_mib=plain.ram_tier_mib if counts_ram_tier(budget_kind) else 0,
                       type_k=plain.kv_types[0], type_v=plain.kv_types[1])


def draft_for(entry: CatalogEntry, rs: db.RunnerSettings | None,
              entries: list[CatalogEntry]) -> tuple[CatalogEntry | None, str | None]:
    """The model's draft model (runner_settings.draft_model) among the catalog's entries, and a note for the Models
    page when one is chosen but cannot draft now (gone, unreadable, or of another vocabulary since it was chosen)."""
    name = rs.draft_model if rs else None
    if not name:
        return None, None
    draft = next((e for e in entries if e.name == name), None)
    if draft is None or not draft.usable:
        return None, f"draft model {name} is not in the models folder (or unreadable): no draft model"
    problem = draft_problem(entry, draft)
    if problem:
        return None, f"draft model {name}: {problem}; no draft model"
    return draft, None


def draft_problem(entry: CatalogEntry, draft: CatalogEntry) -> str | None:
    """Why `draft` cannot draft for `entry`, or None (the runner checks the token texts again when it loads)."""
    if draft.name == entry.name:
        return "a model cannot be its own draft model"
    if entry.vocab_digest is None or draft.vocab_digest != entry.vocab_digest:
        return (f"its vocabulary is not {entry.name}'s (a draft model must tokenize as the model does: a smaller "
                "model of the same family)")
    return None


def runner_spec(entry: CatalogEntry, rs: db.RunnerSettings | None, defaults: dict,
                sizing: RunnerSizing | None = None, kv_dir: Path | None = None,
                draft: CatalogEntry | None = None) -> RunnerSpec:
    """How a model's runner starts: its own runner settings where set, else the stored runner_* defaults,
    else the sizing (app.residency.estimate.size_runner). Speculation: the model's setting (auto when unset,
    see app.residency.runner_spec.spec_type_for); `draft`: its draft model (draft_for), used while it is auto."""
    kind = rs.kind if rs else "hearth"
    return RunnerSpec(
        model_name=entry.name,
        model_path=str(entry.path),
        kind=kind,
        binary_path=rs.binary_path if rs else None,
        n_ctx=(rs and rs.n_ctx) or int(defaults["ctx"] or (sizing.n_ctx if sizing else 4096)),
        parallel=(rs and rs.parallel) or int(defaults["parallel"] or (sizing.parallel if sizing else 4)),
        n_batch=(rs and rs.n_batch) or int(defaults["batch"]),
        threads=(rs and rs.threads) or int(defaults["threads"] or os.cpu_count() or 1),
        gpu_layers=(rs and rs.gpu_layers) or 0,
        mode=(rs and rs.mode) or "continuous",
        prefix_cache=bool(defaults.get("prefix_cache", True)),
        extra_args=parse_runner_args(defaults.get("args")).get(entry.name, ()),
        spec_type=spec_type_for(kind, rs.speculation if rs else None, draft_model=draft is not None),
        draft_model_path=str(draft.path) if draft is not None else None,
        cache_ram_mib=_int_or(defaults.get("cache_ram_mib"), DEFAULT_CACHE_RAM_MIB),
        cache_disk_dir=str(kv_dir) if kv_dir is not None and _int_or(defaults.get("cache_disk_mib"), 0) else None,
        cache_disk_mib=_int_or(defaults.get("cache_disk_mib"), DEFAULT_CACHE_DISK_MIB),
        cache_disk_max_age_h=float(defaults.get("cache_disk_max_age_h") or 0),
        mmproj=str(entry.mmproj) if entry.mmproj else None,
        image_url_fetch=bool(defaults.get("image_url_fetch")),
        image_url_hosts=defaults.get("image_url_hosts") or None,
        cache_type_k=(rs and rs.cache_type_k) or DEFAULT_KV_TYPE,
        cache_type_v=(rs and rs.cache_type_v) or DEFAULT_KV_TYPE,
        n_cpu_moe=(rs and rs.n_cpu_moe) or 0,
        devices=tuple(d for d in ((rs and rs.devices) or "").split(",") if d),
        tensor_split=tuple(float(x) for x in ((rs and rs.tensor_split) or "").split(",") if x),
        split_mode=(rs and rs.split_mode) or "layer",
        main_gpu=(rs and rs.main_gpu) or 0,
    )


def fit_to_devices(entry: CatalogEntry, rs: db.RunnerSettings | None, spec: RunnerSpec,
                   devices: list[Device]) -> tuple[RunnerSpec, str | None]:
    """A model whose GPU layers the admin left unset, on a box with a GPU: its offload, experts in RAM and (unless
    chosen) KV type fitted to the GPUs' free memory (app.residency.fit), with the reason for the Models page.
    Without a GPU, or with GPU layers set, the spec is unchanged."""
    if not any(d.is_gpu for d in devices) or (rs is not None and rs.gpu_layers is not None):
        return spec, None
    try:
        tensors = model_tensors(entry.path)
    except (OSError, GgufError):
        return spec, None
    chosen_kv = spec.kv_types[0] if (rs and rs.cache_type_k) else None
    # Layers on lavapipe load with flash attention off (app.engine.backends.flash_attn_for): the fit counts the scores.
    flash_attn = not any(d.is_gpu and is_software_vulkan(d.description) for d in devices)
    choice = fit_runner(entry, tensors, devices, spec.parallel, spec.n_batch, n_ctx=spec.n_ctx, kv_type=chosen_kv,
                        flash_attn=flash_attn)
    fitted = replace(spec, gpu_layers=choice.n_gpu_layers,
                     n_cpu_moe=spec.n_cpu_moe if (rs and rs.n_cpu_moe is not None) else choice.n_cpu_moe,
                     cache_type_k=choice.type_k, cache_type_v=choice.type_v)
    return fitted, f"fit to the GPU: {choice.reason}"


def need_by_device(entry: CatalogEntry, spec: RunnerSpec, estimate: MemoryEstimate,
                   devices: list[Device]) -> dict[str, int]:
    """The runner's bytes per device for the residency's budget per device (app.residency.fit.device_need): all in
    RAM without a GPU layer or a readable header."""
    if not spec.gpu_layers or not any(d.is_gpu for d in devices):
        return {CPU: estimate.total_bytes}
    try:
        tensors = model_tensors(entry.path)
    except (OSError, GgufError):
        return {CPU: estimate.total_bytes}
    return device_need(entry, tensors, spec, estimate.total_bytes, estimate.kv_bytes, estimate.compute_bytes, devices)


def fit_ram_tier(entry: CatalogEntry, spec: RunnerSpec, estimate: MemoryEstimate, budget: int,
                 kind: str) -> tuple[RunnerSpec, MemoryEstimate, str | None]:
    """A hearth runner whose RAM tier alone keeps it from fitting the (RAM) budget gets the tier the budget leaves
    instead of the setting's, down to off, so a model that fits without the tier still loads; (spec, estimate,
    a note for the Models page, or None when nothing changed). A --cache-ram of the model's runner_args stands."""
    if (not counts_ram_tier(kind) or spec.kind != "hearth" or spec.ram_tier_mib == 0 or spec.ram_tier_mib != spec.cache_ram_mib
            or (not estimate.ram_tier_unbounded and estimate.total_bytes <= budget)):
        return spec, estimate, None
    room_mib = max(0, (budget - estimate.at_load_bytes) // MIB)
    if not estimate.ram_tier_unbounded and room_mib >= spec.cache_ram_mib:
        return spec, estimate, None
    wanted = "no limit" if estimate.ram_tier_unbounded else f"{spec.cache_ram_mib:,} MiB"
    fitted = replace(spec, cache_ram_mib=int(room_mib))
    estimate = estimate_memory(entry, fitted.n_ctx, fitted.parallel, fitted.n_batch,
                               n_outputs_extra=fitted.n_outputs_extra, ram_tier_mib=fitted.ram_tier_mib,
                               type_k=fitted.kv_types[0], type_v=fitted.kv_types[1])
    return fitted, estimate, (f"RAM tier {room_mib:,} MiB instead of runner_cache_ram_mib's {wanted}: what the "
                              f"{budget // MIB:,} MiB memory budget leaves beside the rest of the runner")


def _int_or(value, default: int) -> int:
    return default if value is None else int(value)


@dataclass(frozen=True)
class _Scan:
    """One rescan's result, swapped in whole so readers never see half of two scans."""

    entries: list[CatalogEntry] = field(default_factory=list)
    specs: dict[str, ModelSpec] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)


class Catalog:
    """The models folder's entries, what of it can be served (specs) and under which names (aliases)."""

    def __init__(self, sessions: sessionmaker, settings: SettingsCache, data_dir: Path, models_dir: Path,
                 default_model: Path | None, devices: Callable[[], list[Device]] | None = None):
        self.sessions = sessions
        self.settings = settings
        self.data_dir = data_dir
        self.models_dir = models_dir
        self.default_model = default_model
        # The devices llama.cpp sees (app.devices), read at each rescan: with a GPU, a model whose GPU layers are
        # unset is fitted to its free memory (fit_to_devices). None or an empty list: no GPU, nothing changes.
        self.devices = devices or (lambda: [])
        # Set while the embedded default model is assembled in the background (first run).
        self.default_model_assembly: BackgroundAssembly | None = None
        self._lock = threading.Lock()
        self._scan = _Scan()
        self._shadowing: set[str] = set()  # aliases already logged as standing aside for a model's name

    @classmethod
    def open(cls, data_dir: Path, sessions: sessionmaker, settings: SettingsCache, default_model: Path | None,
             models_dir_override: str | None = None, devices: Callable[[], list[Device]] | None = None) -> Catalog:
        """The catalog over the folder serve uses (see resolve_models_dir), created if missing, scanned once;
        `devices` gives the devices llama.cpp sees (the live probe), for the fit."""
        models_dir = resolve_models_dir(data_dir, settings.get("models_dir"), models_dir_override)
        models_dir.mkdir(parents=True, exist_ok=True)
        catalog = cls(sessions, settings, data_dir, models_dir, default_model, devices)
        catalog.rescan()
        return catalog

    @property
    def entries(self) -> list[CatalogEntry]:
        """Every model file found by the last scan, usable or not."""
        return self._scan.entries

    def model_specs(self) -> dict[str, ModelSpec]:
        """Servable models by name (cheap: rebuilt only on rescan)."""
        return self._scan.specs

    def aliases(self) -> dict[str, str]:
        """Alias → model name, as the admin set them."""
        return self._scan.aliases

    def pull_name_problem(self, name: str) -> str | None:
        """Why a pulled file may not be served under `name` (its file name's stem), or None.

        A model's name wins over an alias (an alias never shadows a model), so a pulled file named like an alias would
        take the requests meant for the alias's model: refused, naming the alias."""
        if name.lower() in RESERVED_NAMES:
            return f"a pulled file cannot be called '{name}': requests use that name for the household's default model"
        with self.sessions() as s:
            rows = s.execute(select(db.Model.name, db.Model.alias).where(db.Model.alias.is_not(None))).all()
        for model, alias in rows:
            if name in (alias, alias.removesuffix(OLLAMA_DEFAULT_TAG)) and name != model:
                return (f"'{name}' is the alias of the model '{model}': a pulled file under that name would take the "
                        f"alias's requests. Change the alias first (hearth models set {model} --alias NEW, or on the "
                        "Models page), or pull a file of another name")
        return None

    def delete(self, name: str, residency: ResidencyManager) -> Path:
        """Delete a model file of the models folder (unloaded first); its path.

        Raises ModelNotFound, ModelEmbedded, or ModelBusy while it serves."""
        entry = next((e for e in self.entries if e.name == name), None)
        if entry is None:
            raise ModelNotFound(name, sorted(self.model_specs()))
        if entry.source != "folder":
            raise ModelEmbedded(name)
        residency.unload(name, "deleted")
        Path(entry.path).unlink(missing_ok=True)
        self.rescan()
        return Path(entry.path)

    def expire_kv_cache(self) -> int:
        """Delete the KV disk tier's entries unused for runner_cache_disk_max_age_h, and those of removed members
        (the expire_kv_cache job); returns how many."""
        with self.sessions() as s:
            members = set(s.scalars(select(db.Member.name)))
        return expire_kv_cache(self.data_dir, partial(self.settings.get, MAX_AGE_SETTING)) + remove_orphans(
            self.data_dir, members)

    def rescan(self) -> list[CatalogEntry]:
        """The `rescan_catalog` job: scan the folder, record every model in the store, rebuild what can be served."""
        with self._lock:
            entries = scan(self.models_dir, self.default_model, previous=self._scan.entries)
            specs: dict[str, ModelSpec] = {}
            aliases: dict[str, str] = {}
            with self.sessions() as s:
                defaults = {k: get_setting(s, f"runner_{k}") for k in RUNNER_DEFAULTS}
                memory = memory_budget(self.settings)
                budget = memory.usable_bytes
                devices = self.devices()
                for e, row in zip(entries, record_catalog(s, entries, datetime.now(UTC))):
                    if not e.usable:
                        continue
                    rs = s.scalar(select(db.RunnerSettings).where(db.RunnerSettings.model_id == row.id))
                    sizing = runner_sizing(e, rs, defaults, budget, memory.kind)
                    draft, draft_note = draft_for(e, rs, entries)
                    spec = runner_spec(e, rs, defaults, sizing, kv_dir=self.data_dir / KV_CACHE_DIR, draft=draft)
                    spec, fit_note = fit_to_devices(e, rs, spec, devices)
                    estimate = estimate_memory(e, spec.n_ctx, spec.parallel, spec.n_batch,
                                               n_outputs_extra=spec.n_outputs_extra, ram_tier_mib=spec.ram_tier_mib,
                                               flash_attn=flash_attn_possible(spec.gpu_layers),
                                               type_k=spec.kv_types[0], type_v=spec.kv_types[1])
                    if spec.draft_flag:
                        estimate = with_draft(estimate, draft, spec.n_ctx, spec.parallel, spec.n_batch)
                    spec, estimate, tier_note = fit_ram_tier(e, spec, estimate, budget, memory.kind)
                    need = need_by_device(e, spec, estimate, devices)
                    nodes = s.scalars(select(db.Node).where(db.Node.model_id == row.id, db.Node.enabled)).all()
                    specs[e.name] = ModelSpec(
                        name=e.name, path=str(e.path), estimate_bytes=counted_bytes(estimate, memory.kind),
                        policy=row.policy,
                        keep_alive_s=row.keep_alive_s, runner=spec,
                        remote=tuple((n.url, n.label or n.url) for n in nodes),
                        sizing_note="; ".join(n for n in (sizing.reason if sizing else None, fit_note, tier_note,
                                                          draft_note) if n) or None,
                        weights=(rs.weights if rs else None) or WEIGHTS_WARM,
                        need_by_device=need, fit_note=fit_note,
                    )
                    if row.alias:
                        aliases[row.alias] = e.name
                s.commit()
            # An alias set before the rule (or a model file added later under the alias's name) never
            # shadows a model: the model keeps its name, the alias stands aside.
            names = {e.name for e in entries}
            for alias in sorted(set(aliases) & names):
                if alias not in self._shadowing:
                    self._shadowing.add(alias)
                    log.warning("alias %r of %s is also a model's name; the model keeps it (change the alias with "
                                "`hearth models set %s --alias NEW`)", alias, aliases[alias], aliases[alias])
                del aliases[alias]
            self._scan = _Scan(entries, specs, aliases)
            return entries

    # -- the embedded default model ------------------------------------------------------------

    def assemble_default_model(self, after_ready: Callable[[], None] = lambda: None) -> None:
        """Assemble the embedded default model in the background; once ready, list it, then call after_ready."""
        self.default_model_assembly = BackgroundAssembly(self.data_dir, self._default_model_ready,
                                                         after_ready=after_ready)
        self.default_model_assembly.start()

    def _default_model_ready(self, path: Path) -> None:
        self.default_model = path
        self.rescan()

    def default_model_progress(self) -> dict | None:
        """How far the background assembly of the default model is (phase, bytes, percent, error); None when ready."""
        assembly = self.default_model_assembly
        return None if assembly is None else assembly.progress()

    def default_model_name(self) -> str | None:
        """The model a request gets when neither it nor its class names one."""
        configured = self.settings.get("default_model")
        if configured:
            return configured
        if self.default_model_progress() is not None:
            return self.default_model_assembly.model_name
        defaults = [e.name for e in self.entries if e.source == "default" and e.usable]
        return defaults[0] if defaults else next(iter(self.model_specs()), None)

    def resolve(self, requested: str | None, class_default: str | None = None) -> str:
        """The catalog name for a request's model (aliases, class default, household default).

        Raises DefaultModelPending, ModelUnusable or ModelNotFound when it cannot be served now."""
        current = self._scan
        name = requested or class_default or self.default_model_name()
        if name in ("default", None, ""):
            name = self.default_model_name()
        if name not in current.specs:
            # A model's own name always means that model: an alias only names what no model is called.
            name = current.aliases.get(name, name)
        progress = self.default_model_progress()
        if progress is not None and name == progress["model"]:
            raise DefaultModelPending(name, progress)
        if name not in current.specs:
            unusable = {e.name: e.unusable_reason for e in current.entries if not e.usable}
            if name in unusable:
                raise ModelUnusable(name, unusable[name])
            raise ModelNotFound(name, sorted(set(current.specs) | set(current.aliases)))
        return name
