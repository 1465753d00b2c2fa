"""Read-side queries for the Models, Classes, Requests and Members pages.

Pages call these and render what they return; nothing here writes, collects or schedules.
Every query is bounded (a page of rows, an aggregate, a LIMIT), so a page stays fast with a
100k-row request log: the request log pages by keyset on (arrival_at, id), which the
`ix_requests_arrival_at` index (arrival_at, then rowid = id) serves in order, and per-class
figures are one aggregate over the window instead of one ORM object per request.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, func, or_, select, tuple_
from sqlalchemy.orm import Session

from app.engine.prefix_cache import reuse_note
from app.gateway.tokens import TokenInfo, list_tokens
from app.gguf_meta import projector_modalities
from app.residency.budget import KIND_RAM, KIND_VRAM, counted_bytes, counts_ram_tier
from app.residency.estimate import MemoryEstimate, estimate_memory, with_draft
from app.residency.manager import ModelState
from app.residency.pagecache import cached_fraction
from app.services.catalog import Catalog, draft_problem
from app.store.models import (
    REQUEST_STATUSES,
    TTFT_DELIVERED,
    Member,
    RequestClass,
    RequestRecord,
    ResidencyEvent,
    RunnerSettings,
)
from app.store.models import Model as ModelRow
from app.telemetry.analysis import ClassFigures, fairness

# Time ranges offered on the Classes and Requests pages, by the key used in URLs.
RANGES = {"1h": timedelta(hours=1), "24h": timedelta(hours=24), "7d": timedelta(days=7)}
RANGE_LABELS = {"1h": "1 hour", "24h": "24 hours", "7d": "7 days"}
PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
EVENT_LIMIT = 20
LOG_LINES_SHOWN = 20
# Cold starts averaged per model for the "usual" figure and the load-progress estimate.
COLD_START_HISTORY = 10
LOADS_SHOWN = 5  # the last loads taken apart on a model's card


def utc_now(clock=None) -> datetime:
    """Now as an aware UTC datetime, from an injected clock (Unix seconds) when the app has one."""
    return datetime.fromtimestamp(clock(), UTC) if clock is not None else datetime.now(UTC)


class QueryError(ValueError):
    """A filter or cursor in the URL that cannot be used (the message says what to fix)."""


# -- Classes -------------------------------------------------------------------------------------------


def class_rows(session: Session) -> list[RequestClass]:
    """Every class, by priority then name."""
    return list(session.scalars(select(RequestClass).order_by(RequestClass.priority, RequestClass.name)))


def class_figures_sql(session: Session, start: datetime, end: datetime) -> list[ClassFigures]:
    """app.telemetry.analysis.class_figures as one aggregate in SQLite, against the stored class policies."""
    r, c = RequestRecord, RequestClass
    # Same rule as analysis.meets_targets: succeeded, TTFT within target, TPOT within target or absent.
    met = case(
        (and_(r.status == "ok", r.ttft_ms.is_not(None), func.coalesce(r.ttft_kind, TTFT_DELIVERED) == TTFT_DELIVERED,
              r.ttft_ms <= c.ttft_target_ms,
              or_(r.tpot_ms.is_(None), r.tpot_ms <= c.tpot_target_ms)), 1),
        else_=0,
    )
    # Same rule as analysis.judged_by_slo: rows logged before migration 0010 measured another TTFT.
    judged = case((func.coalesce(r.ttft_kind, TTFT_DELIVERED) == TTFT_DELIVERED, 1), else_=0)
    rows = session.execute(
        select(r.class_name, func.count(), func.sum(met), func.coalesce(func.sum(r.completion_tokens), 0), c.weight,
               func.sum(judged), func.coalesce(func.sum(r.num_preemptions), 0))
        .join(c, c.name == r.class_name)
        .where(r.arrival_at >= start, r.arrival_at < end)
        .group_by(r.class_name)
        .order_by(r.class_name)
    )
    return [ClassFigures(name, n, int(m or 0), int(tokens), float(w), judged=int(j or 0), preemptions=int(p))
            for name, n, m, tokens, w, j, p in rows]


@dataclass(frozen=True)
class ClassStats:
    """Per-class SLO figures over a window and the fairness among classes with demand."""

    range_key: str
    start: datetime
    end: datetime
    figures: dict[str, ClassFigures]
    fairness: float | None
    # Weight-normalised service (generated tokens / weight) per class with demand: the values Jain's index is taken over.
    service_per_weight: dict[str, float]


def class_stats(session: Session, range_key: str, now: datetime) -> ClassStats:
    """SLO attainment per class and Jain's fairness index over the last `range_key` before `now`."""
    if range_key not in RANGES:
        raise QueryError(f"unknown range '{range_key}'; choose one of {', '.join(RANGES)}")
    start = now - RANGES[range_key]
    figures = class_figures_sql(session, start, now)
    per_weight = {f.name: f.completion_tokens / f.weight for f in figures if f.requests and f.weight > 0}
    return ClassStats(range_key, start, now, {f.name: f for f in figures}, fairness(figures), per_weight)


@dataclass(frozen=True)
class Acceptance:
    """Speculative decoding of one class over a window, from the request log: draft tokens verified and kept."""

    requests: int  # requests that drafted
    draft_tokens: int
    accepted: int

    @property
    def rate(self) -> float | None:
        """Accepted / drafted: the share of draft tokens the runner kept (None without drafts)."""
        return self.accepted / self.draft_tokens if self.draft_tokens else None


def class_acceptance(session: Session, start: datetime, end: datetime) -> dict[str, Acceptance]:
    """Per class, the requests of the window that drafted and their draft tokens verified and kept (one aggregate)."""
    r = RequestRecord
    rows = session.execute(
        select(r.class_name, func.count(), func.sum(r.draft_tokens), func.coalesce(func.sum(r.draft_accepted), 0))
        .where(r.arrival_at >= start, r.arrival_at < end, r.draft_tokens > 0)
        .group_by(r.class_name)
    )
    return {name: Acceptance(int(n), int(drafted), int(kept)) for name, n, drafted, kept in rows if name}


# -- Requests ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestFilters:
    """What the request log is narrowed to; empty strings mean "any"."""

    member: str = ""
    class_name: str = ""
    model: str = ""
    status: str = ""
    range_key: str = ""

    def as_args(self) -> dict[str, str]:
        """The non-empty filters as URL query arguments."""
        args = {"member": self.member, "class": self.class_name, "model": self.model, "status": self.status,
                "range": self.range_key}
        return {k: v for k, v in args.items() if v}


def parse_request_filters(args: Any) -> RequestFilters:
    """Filters from URL arguments (a Mapping); raises QueryError for a status or range that does not exist."""
    f = RequestFilters(
        member=(args.get("member") or "").strip(),
        class_name=(args.get("class") or "").strip(),
        model=(args.get("model") or "").strip(),
        status=(args.get("status") or "").strip(),
        range_key=(args.get("range") or "").strip(),
    )
    if f.status and f.status not in REQUEST_STATUSES:
        raise QueryError(f"unknown status '{f.status}'; choose one of {', '.join(REQUEST_STATUSES)}")
    if f.range_key and f.range_key not in RANGES:
        raise QueryError(f"unknown range '{f.range_key}'; choose one of {', '.join(RANGES)}")
    return f


def encode_cursor(row: RequestRecord) -> str:
    """A keyset cursor naming one row's place in the log: '<arrival unix µs>-<id>'."""
    return f"{round(row.arrival_at.timestamp() * 1_000_000)}-{row.id}"


def decode_cursor(text: str) -> tuple[datetime, int]:
    """(arrival_at, id) of a cursor made by encode_cursor; QueryError if it is not one."""
    try:
        micros, ident = text.split("-", 1)
        return datetime.fromtimestamp(int(micros) / 1_000_000, UTC), int(ident)
    except (ValueError, OverflowError, OSError):
        raise QueryError(f"'{text}' is not a page cursor; start again from the newest requests") from None


@dataclass(frozen=True)
class RequestPage:
    """One page of the request log, newest first, with cursors to the neighbouring pages."""

    rows: list[RequestRecord]
    older: str | None
    newer: str | None


def request_page(session: Session, filters: RequestFilters, now: datetime, before: str | None = None,
                 after: str | None = None, limit: int = PAGE_SIZE) -> RequestPage:
    """Up to `limit` requests matching `filters`, older than `before` or newer than `after` (keyset paging)."""
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise QueryError(f"page size must be between 1 and {MAX_PAGE_SIZE} (got {limit})")
    r = RequestRecord
    conds = []
    if filters.member:
        conds.append(r.member_name == filters.member)
    if filters.class_name:
        conds.append(r.class_name == filters.class_name)
    if filters.model:
        conds.append(r.model == filters.model)
    if filters.status:
        conds.append(r.status == filters.status)
    if filters.range_key:
        conds.append(r.arrival_at >= now - RANGES[filters.range_key])
    key = tuple_(r.arrival_at, r.id)
    if after:
        # Walk forwards from the cursor, then turn the page back into newest-first order.
        conds.append(key > tuple_(*decode_cursor(after)))
        query = select(r).where(*conds).order_by(r.arrival_at, r.id).limit(limit + 1)
        rows = list(session.scalars(query))
        more_newer = len(rows) > limit
        rows = rows[:limit][::-1]
        newer = encode_cursor(rows[0]) if rows and more_newer else None
        older = encode_cursor(rows[-1]) if rows else None
        return RequestPage(rows, older, newer)
    if before:
        conds.append(key < tuple_(*decode_cursor(before)))
    query = select(r).where(*conds).order_by(r.arrival_at.desc(), r.id.desc()).limit(limit + 1)
    rows = list(session.scalars(query))
    older = encode_cursor(rows[limit - 1]) if len(rows) > limit else None
    rows = rows[:limit]
    newer = encode_cursor(rows[0]) if rows and before else None
    return RequestPage(rows, older, newer)


def filter_choices(session: Session) -> dict[str, list[str]]:
    """Values offered in the filter fields: from the small tables, never a scan of the log."""
    return {
        "member": list(session.scalars(select(Member.name).order_by(Member.name))),
        "class": [c.name for c in class_rows(session)],
        "model": list(session.scalars(select(ModelRow.name).order_by(ModelRow.name))),
        "status": list(REQUEST_STATUSES),
    }


def request_count(session: Session) -> int:
    """Requests in the log (SQLite counts the narrowest index: a few ms at 100k rows)."""
    return int(session.scalar(select(func.count()).select_from(RequestRecord)))


# -- Members -------------------------------------------------------------------------------------------


@dataclass
class MemberTokens:
    """A member with their tokens, newest first."""

    name: str
    created_at: datetime | None
    tokens: list[TokenInfo] = field(default_factory=list)

    @property
    def active(self) -> int:
        """Tokens not revoked."""
        return sum(1 for t in self.tokens if not t.revoked)


def members_with_tokens(session: Session) -> list[MemberTokens]:
    """Every member (even one whose tokens are all revoked) with their tokens."""
    members = {m.name: MemberTokens(m.name, m.created_at) for m in session.scalars(select(Member).order_by(Member.name))}
    for t in list_tokens(session):
        members.setdefault(t.member, MemberTokens(t.member, None)).tokens.append(t)
    return list(members.values())


# -- Models --------------------------------------------------------------------------------------------


def recent_events(session: Session, limit: int = EVENT_LIMIT, model: str | None = None) -> list[ResidencyEvent]:
    """The latest residency events (loads, unloads, evictions, crashes), newest first."""
    query = select(ResidencyEvent).order_by(ResidencyEvent.at.desc(), ResidencyEvent.id.desc()).limit(limit)
    if model:
        query = query.where(ResidencyEvent.model_name == model)
    return list(session.scalars(query))


@dataclass(frozen=True)
class LoadPart:
    """One part of a load's time: what it was, how long, and the tier it came from (None: no tier)."""

    key: str  # start | read | upload | context | restore | prefill | whole
    label: str
    ms: float
    tier: str | None = None


@dataclass(frozen=True)
class LoadBreakdown:
    """One load taken apart for the Models page's stacked bar: the runner's start to ready, then its first request."""

    at: datetime
    cold_start_ms: float
    parts: tuple[LoadPart, ...]
    split: bool  # False: a stock llama-server, only its start to /health ok is known

    @property
    def total_ms(self) -> float:
        """The load and its first request's restore and prefill: the width of the whole bar."""
        return sum(p.ms for p in self.parts)

    def pct(self, part: LoadPart, scale_ms: float) -> float:
        """The part's width in percent of `scale_ms` (the longest load shown, so loads compare by length)."""
        return 100.0 * part.ms / scale_ms if scale_ms > 0 else 0.0


TIER_WORDS = {"page_cache": "page cache", "disk": "disk", "ram": "host RAM", "none": None}


def load_breakdown(ev: ResidencyEvent) -> LoadBreakdown | None:
    """The parts of one load event (None: no cold start recorded). The runner's own phases sit inside cold_start_ms;
    what they leave of it is the process start (Python, llama.cpp, the engine); restore and prefill come after."""
    if ev.cold_start_ms is None:
        return None
    phases = (ev.load_read_ms, ev.load_upload_ms, ev.load_context_ms)
    if all(v is None for v in phases):
        # Where the weights came from is still known: serve judged it before the start.
        whole = LoadPart("whole", "start to ready (not split)", ev.cold_start_ms,
                         f"weights in {TIER_WORDS[ev.weights_source]}" if ev.weights_source in ("page_cache", "disk")
                         else None)
        return LoadBreakdown(ev.at, ev.cold_start_ms, (whole,), split=False)
    read, upload, context = (v or 0.0 for v in phases)
    parts = [LoadPart("start", "process start", max(0.0, ev.cold_start_ms - read - upload - context)),
             LoadPart("read", "weights read", read, TIER_WORDS.get(ev.weights_source or "", None))]
    if ev.load_upload_ms is not None:
        parts.append(LoadPart("upload", "GPU upload", upload, "GPU"))
    parts.append(LoadPart("context", "context built", context))
    if ev.load_restore_ms is not None and ev.kv_source not in (None, "none"):
        parts.append(LoadPart("restore", "KV restored", ev.load_restore_ms, TIER_WORDS.get(ev.kv_source)))
    if ev.first_prefill_ms is not None:
        parts.append(LoadPart("prefill", "first prefill", ev.first_prefill_ms))
    return LoadBreakdown(ev.at, ev.cold_start_ms, tuple(parts), split=True)


def load_history(session: Session, names: list[str]) -> dict[str, dict[str, Any]]:
    """Per model: its last COLD_START_HISTORY cold starts and measured footprints, its last loads taken apart
    (LOADS_SHOWN), and its last event kind."""
    out: dict[str, dict[str, Any]] = {n: {"cold_starts_ms": [], "measured_bytes": None, "last_event": None,
                                          "loads": []} for n in names}
    for name in names:
        events = list(session.scalars(
            select(ResidencyEvent)
            .where(ResidencyEvent.model_name == name, ResidencyEvent.event == "load")
            .order_by(ResidencyEvent.at.desc()).limit(COLD_START_HISTORY)
        ))
        loads = [(ev.cold_start_ms, ev.measured_bytes) for ev in events]
        out[name]["cold_starts_ms"] = [ms for ms, _ in loads if ms is not None]
        out[name]["measured_bytes"] = next((b for _, b in loads if b), None)
        out[name]["loads"] = [b for b in (load_breakdown(ev) for ev in events[:LOADS_SHOWN]) if b is not None]
        out[name]["last_event"] = session.scalar(
            select(ResidencyEvent.event).where(ResidencyEvent.model_name == name)
            .order_by(ResidencyEvent.at.desc(), ResidencyEvent.id.desc()).limit(1)
        )
    return out


@dataclass(frozen=True)
class LoadProgress:
    """How far a load has got: seconds so far against the model's usual cold start (when known)."""

    elapsed_s: float
    expected_s: float | None

    @property
    def pct(self) -> int | None:
        """Percent of the usual cold start elapsed, held at 99 until the runner reports ready."""
        if not self.expected_s:
            return None
        return min(99, int(100 * self.elapsed_s / self.expected_s))


@dataclass
class ModelCard:
    """Everything the Models page shows about one catalog entry."""

    name: str
    source: str
    usable: bool
    unusable_reason: str | None
    architecture: str | None
    n_params: int | None
    quantization: str | None
    n_ctx_train: int | None
    size_bytes: int
    path: str
    prefix_reuse: str
    policy: str
    keep_alive_s: float
    estimate: MemoryEstimate | None
    n_ctx: int | None
    parallel: int | None
    state: ModelState
    label: str
    badge: str  # the label's colour: ok, warn, bad or neutral
    in_flight: int = 0
    idle_s: float | None = None
    measured_bytes: int | None = None
    n_batch: int | None = None
    sizing_note: str | None = None  # why these slots and cells, when sized from the memory budget
    rss_bytes: int | None = None
    cold_start_ms: float | None = None
    cold_starts_ms: list[float] = field(default_factory=list)
    progress: LoadProgress | None = None
    # What its chat template says it can do (the catalog's detection): answer format, native tools, reasoning.
    chat_format: str | None = None
    native_tools: bool = False
    reasoning: bool = False
    # The projector the catalog paired with it (its runner gets --mmproj), None: text only; and what it takes.
    mmproj: str | None = None
    mmproj_vision: bool = False
    mmproj_audio: bool = False
    error: str | None = None
    log_tail: list[str] = field(default_factory=list)
    nodes: list[dict] = field(default_factory=list)
    # Speculative decoding: the model's setting (auto when unset), its runner's kind, the --spec-type it gets
    # (None: the runner's own default) and the logit rows that reserves (counted in the estimate).
    speculation: str = "auto"
    runner_kind: str = "hearth"
    spec_type: str | None = None
    draft_rows: int = 0
    # The draft model: the one chosen ("" none), the catalog's models that may draft for this one (same vocabulary,
    # smaller file), and the file its runner gets with -md (None: it drafts without a model).
    draft_model: str = ""
    draft_choices: list[str] = field(default_factory=list)
    draft_path: str | None = None
    # Warm weights: the model's choice (warm when unset) and its GGUF's share in the page cache now (None: unknown).
    weights: str = "warm"
    page_cache_pct: float | None = None
    # KV cache types: the model's setting (K, V; f16 when unset) and the -ctk/-ctv its runner gets (runner_args' own
    # win: then kv_types is what they say).
    kv_types: tuple[str, str] = ("f16", "f16")
    kv_flag: list[str] = field(default_factory=list)
    # Where its weights go: the model's settings as the placement form shows them (n_cpu_moe, devices, tensor_split,
    # split_mode, main_gpu), the flags its runner gets, and, while resident, its bytes per device as placed.
    placement: dict[str, str] = field(default_factory=dict)
    placement_flag: list[str] = field(default_factory=list)
    placed: dict[str, int] = field(default_factory=dict)
    fit_note: str | None = None
    loads: list[LoadBreakdown] = field(default_factory=list)

    @property
    def loads_scale_ms(self) -> float:
        """The longest of the loads shown: every bar is drawn to this one's scale."""
        return max((b.total_ms for b in self.loads), default=0.0)
    # Whether the memory budget reserves the RAM tier's budget (a RAM budget does; a VRAM one does not).
    ram_tier_counted: bool = True

    @property
    def counted_bytes(self) -> int | None:
        """What the memory budget reserves for this model's runner (its estimate, the RAM tier as the kind says)."""
        if self.estimate is None:
            return None
        return counted_bytes(self.estimate, KIND_RAM if self.ram_tier_counted else KIND_VRAM)

    @property
    def usual_cold_start_ms(self) -> float | None:
        """Median of the recorded cold starts."""
        return statistics.median(self.cold_starts_ms) if self.cold_starts_ms else None

    @property
    def estimate_error_pct(self) -> float | None:
        """(measured − estimate at load) / estimate at load, in percent, when both are known: a load is measured before
        its RAM tier holds anything, so the tier's budget is left out of the comparison."""
        if self.estimate is None or not self.measured_bytes:
            return None
        at_load = self.estimate.at_load_bytes
        return 100.0 * (self.measured_bytes - at_load) / at_load

    @property
    def dom_id(self) -> str:
        """An HTML id for the model's card (names may hold dots and other characters ids should not)."""
        return "model-" + re.sub(r"[^A-Za-z0-9_-]", "-", self.name)

    @property
    def loading(self) -> bool:
        """Whether a runner is starting for it right now."""
        return self.state == ModelState.LOADING


def state_label(status: dict | None, last_event: str | None) -> tuple[ModelState, str, str]:
    """(state, words for the admin, badge): resident / loading / crashed / failed / evicted / not loaded."""
    if status is None:
        return ModelState.UNLOADED, "not loaded", "neutral"
    state = status["state"]
    if state == ModelState.READY:
        busy = status.get("in_flight") or 0
        if busy:
            return ModelState.READY, f"resident · serving {busy}", "ok"
        idle = status.get("idle_s")
        return ModelState.READY, "resident · idle" + (f" {_duration(idle)}" if idle is not None else ""), "ok"
    if state == ModelState.LOADING:
        return ModelState.LOADING, "loading", "warn"
    if state == ModelState.CRASHED:
        return ModelState.CRASHED, "crashed · restarts on the next request", "bad"
    if state == ModelState.FAILED:
        return ModelState.FAILED, "failed to load", "bad"
    if last_event == "evict":
        return ModelState.UNLOADED, "evicted to make room", "warn"
    return ModelState.UNLOADED, "not loaded", "neutral"


def _duration(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    return f"{s // 3600} h {s % 3600 // 60} min"


def model_cards(catalog: Catalog, runner_status: list[dict], session: Session, only: str | None = None,
                budget_kind: str = KIND_RAM) -> list[ModelCard]:
    """Catalog entries (usable and not) joined with their policy, estimate, residency state and history
    (`budget_kind`: the memory budget's, which decides whether the RAM tier is reserved)."""
    entries = [e for e in catalog.entries if only is None or e.name == only]
    rows = {m.name: m for m in session.scalars(select(ModelRow).where(ModelRow.name.in_([e.name for e in entries])))}
    runner_rows = {rs.model_id: rs for rs in session.scalars(
        select(RunnerSettings).where(RunnerSettings.model_id.in_([m.id for m in rows.values()])))}
    statuses = {s["name"]: s for s in runner_status}
    specs = catalog.model_specs()
    history = load_history(session, [e.name for e in entries])
    cards = []
    for e in entries:
        row, status, spec, hist = rows.get(e.name), statuses.get(e.name), specs.get(e.name), history[e.name]
        estimate = None
        if e.usable and spec is not None and spec.runner is not None:
            estimate = estimate_memory(e, spec.runner.n_ctx, spec.runner.parallel, spec.runner.n_batch,
                                       n_outputs_extra=spec.runner.n_outputs_extra,
                                       ram_tier_mib=spec.runner.ram_tier_mib,
                                       type_k=spec.runner.kv_types[0], type_v=spec.runner.kv_types[1])
            draft = next((d for d in catalog.entries if str(d.path) == spec.runner.draft_model_path), None)
            if spec.runner.draft_flag and draft is not None:
                estimate = with_draft(estimate, draft, spec.runner.n_ctx, spec.runner.parallel, spec.runner.n_batch)
        state, label, badge = state_label(status, hist["last_event"])
        vision, audio = projector_modalities(e.mmproj)
        card = ModelCard(
            name=e.name, source=e.source, usable=e.usable, unusable_reason=e.unusable_reason,
            architecture=e.architecture, n_params=e.n_params, quantization=e.quantization,
            n_ctx_train=e.n_ctx_train, size_bytes=e.size_bytes, path=str(e.path),
            prefix_reuse=reuse_note(e.architecture, e.n_swa),
            policy=(row.policy if row else "keep_alive"), keep_alive_s=(row.keep_alive_s if row else 300),
            estimate=estimate, n_ctx=spec.runner.n_ctx if spec and spec.runner else None,
            parallel=spec.runner.parallel if spec and spec.runner else None, state=state, label=label, badge=badge,
            cold_starts_ms=hist["cold_starts_ms"], measured_bytes=hist["measured_bytes"],
            n_batch=spec.runner.n_batch if spec and spec.runner else None,
            sizing_note=spec.sizing_note if spec else None,
            chat_format=e.chat_format, native_tools=e.native_tools, reasoning=e.reasoning,
            mmproj=str(e.mmproj) if e.mmproj is not None else None,
            mmproj_vision=vision, mmproj_audio=audio,
            ram_tier_counted=counts_ram_tier(budget_kind),
        )
        rs = runner_rows.get(row.id) if row else None
        card.speculation = (rs.speculation if rs else None) or "auto"
        card.weights = (rs.weights if rs else None) or "warm"
        card.draft_model = (rs.draft_model if rs else None) or ""
        if e.usable:
            card.draft_choices = [d.name for d in sorted(catalog.entries, key=lambda d: d.size_bytes)
                                  if d.usable and d.size_bytes < e.size_bytes and draft_problem(e, d) is None]
        card.loads = hist["loads"]
        if e.usable:
            frac = cached_fraction(e.path)
            card.page_cache_pct = None if frac is None else 100.0 * frac
        if spec is not None and spec.runner is not None:
            card.runner_kind = spec.runner.kind
            card.spec_type = spec.runner.effective_spec_type
            card.draft_rows = spec.runner.n_outputs_extra
            card.draft_path = spec.runner.draft_model_path if spec.runner.draft_flag else None
            card.kv_types = spec.runner.kv_types
            card.kv_flag = spec.runner.kv_type_flag
            card.placement_flag = spec.runner.placement_flag
            card.fit_note = spec.fit_note
        card.placement = {
            "n_cpu_moe": "" if rs is None or rs.n_cpu_moe is None else ("all" if rs.n_cpu_moe < 0 else str(rs.n_cpu_moe)),
            "devices": (rs.devices if rs else None) or "",
            "tensor_split": (rs.tensor_split if rs else None) or "",
            "split_mode": (rs.split_mode if rs else None) or "layer",
            "main_gpu": str((rs.main_gpu if rs else None) or 0),
        }
        if status is not None:
            card.in_flight = status.get("in_flight") or 0
            card.idle_s = status.get("idle_s")
            card.measured_bytes = status.get("measured_bytes") or card.measured_bytes
            card.rss_bytes = status.get("rss_bytes")
            card.placed = status.get("placed") or {}
            card.cold_start_ms = status.get("cold_start_ms")
            card.error = status.get("error")
            card.log_tail = list(status.get("log_tail") or [])[-LOG_LINES_SHOWN:]
            card.nodes = status.get("nodes") or []
            if state == ModelState.LOADING:
                usual = card.usual_cold_start_ms
                card.progress = LoadProgress(status.get("loading_s") or 0.0, usual / 1000 if usual else None)
        cards.append(card)
    return cards



# -- Overview's first screen -----------------------------------------------------------------------------

# Rows read for the first screen's window at most: a household's busiest 5 minutes is far fewer.
RECENT_LIMIT = 20_000


@dataclass
class RecentClass:
    """One class's requests over the first screen's window: delivered TTFTs and TPOTs, and failures."""

    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    failed: int = 0
    last_error: str | None = None


@dataclass
class RecentMember:
    """One member's requests and generated tokens over the window."""

    requests: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class Recent:
    """What the request log says about the last minutes: per class latencies and failures, per member use."""

    classes: dict[str, RecentClass]
    members: dict[str, RecentMember]


# A request that ended this way failed the household; cancelled and client_stalled are the client's own doing,
# rejected ones were refused by a limit the admin set (the Requests page lists them).
FAILED_STATUSES = ("error", "timeout")


def recent_activity(session: Session, start: datetime, end: datetime) -> Recent:
    """Per class and per member, the request log between start and end (one bounded read, newest first)."""
    r = RequestRecord
    rows = session.execute(
        select(r.class_name, r.member_name, r.status, r.ttft_ms, r.ttft_kind, r.tpot_ms, r.completion_tokens, r.error)
        .where(r.arrival_at >= start, r.arrival_at <= end)
        .order_by(r.arrival_at.desc()).limit(RECENT_LIMIT))
    classes: dict[str, RecentClass] = {}
    members: dict[str, RecentMember] = {}
    for class_name, member, status, ttft, kind, tpot, completion, error in rows:
        c = classes.setdefault(class_name or "unknown", RecentClass())
        if status == "ok":
            if ttft is not None and (kind or TTFT_DELIVERED) == TTFT_DELIVERED:
                c.ttft_ms.append(ttft)
            if tpot is not None:
                c.tpot_ms.append(tpot)
        elif status in FAILED_STATUSES:
            c.failed += 1
            c.last_error = c.last_error or error
        if member:
            m = members.setdefault(member, RecentMember())
            m.requests += 1
            m.completion_tokens += completion or 0
    return Recent(classes, members)
