"""The store's tables as SQLAlchemy 2.0 declarative models.

Every timestamp is a timezone-aware UTC `datetime` in Python and a naive UTC string in SQLite
(`UTCDateTime`); naive datetimes are refused rather than guessed at. Log tables (`requests`,
`residency_events`) keep names, not foreign keys, so history survives renames and deletions.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from app.policy import MODEL_POLICIES, MODES, RUNNER_KINDS
from app.residency.pagecache import WEIGHTS_CHOICES
from app.residency.runner_spec import SPECULATION_SETTINGS

MODEL_SOURCES = ("default", "folder", "remote")
# Checked by the code that writes them, not by CHECK constraints: adding a kind to a large log
# table would otherwise mean rewriting the whole table in an SQLite migration.
# client_stalled: the client stopped reading a streamed answer, which was cancelled (setting client_stall_s).
REQUEST_STATUSES = ("ok", "error", "cancelled", "client_stalled", "timeout", "rejected")
# What a request row's ttft_ms measured. Only TTFT_DELIVERED is time to first token as defined in
# docs/measuring.md (arrival at the gateway → first generated token sent to the client, streamed or
# whole); rows logged before migration 0010 measured the first byte of a stream (the role chunk) or,
# for a whole answer, the queue plus the runner's own TTFT. Charts, SLO and /metrics read only
# TTFT_DELIVERED (or unmarked), so the two kinds never mix.
TTFT_DELIVERED = "delivered"
TTFT_KINDS = (TTFT_DELIVERED, "first_byte", "runner")

# Named constraints are what lets Alembic's batch mode find and alter them on SQLite later.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    """The current time as an aware UTC datetime."""
    return datetime.now(UTC)


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes, stored naive in UTC so text order is time order."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        """Convert to naive UTC; a naive input is an error (its zone is unknown)."""
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware one (e.g. datetime.now(UTC))")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        """Attach UTC to what was stored."""
        return None if value is None else value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    """Declarative base: shared metadata with the naming convention; `datetime` maps to UTCDateTime."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime()}


class Model(Base):
    """A GGUF file (or remote model) the catalog found, with what was read from it and its policy."""

    __tablename__ = "models"
    __table_args__ = (
        CheckConstraint(_one_of("source", MODEL_SOURCES), name="source"),
        CheckConstraint(_one_of("policy", MODEL_POLICIES), name="policy"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    path: Mapped[str | None] = mapped_column(Text)
    source: Mapped[str] = mapped_column(String(16))
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    architecture: Mapped[str | None] = mapped_column(String(64))
    n_params: Mapped[int | None] = mapped_column(BigInteger)
    quantization: Mapped[str | None] = mapped_column(String(32))
    n_ctx_train: Mapped[int | None] = mapped_column(Integer)
    n_layers: Mapped[int | None] = mapped_column(Integer)
    n_head_kv: Mapped[int | None] = mapped_column(Integer)
    head_dim_k: Mapped[int | None] = mapped_column(Integer)
    head_dim_v: Mapped[int | None] = mapped_column(Integer)
    has_chat_template: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("0"))
    usable: Mapped[bool] = mapped_column(Boolean, default=True, server_default=text("1"))
    unusable_reason: Mapped[str | None] = mapped_column(Text)
    policy: Mapped[str] = mapped_column(String(16), default="keep_alive", server_default="keep_alive")
    keep_alive_s: Mapped[int] = mapped_column(Integer, default=300, server_default=text("300"))
    alias: Mapped[str | None] = mapped_column(String(255), unique=True)
    first_seen_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(default=utcnow)


class RunnerSettings(Base):
    """How a model's local runner is started; one row per model, absent means defaults."""

    __tablename__ = "runner_settings"
    __table_args__ = (
        CheckConstraint(_one_of("kind", RUNNER_KINDS), name="kind"),
        CheckConstraint(f"mode IS NULL OR {_one_of('mode', MODES)}", name="mode"),
        CheckConstraint(f"speculation IS NULL OR {_one_of('speculation', SPECULATION_SETTINGS)}", name="speculation"),
        CheckConstraint(f"weights IS NULL OR {_one_of('weights', WEIGHTS_CHOICES)}", name="weights"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), unique=True)
    kind: Mapped[str] = mapped_column(String(16), default="hearth", server_default="hearth")
    binary_path: Mapped[str | None] = mapped_column(Text)
    # None means "the runner's own default" for each of these.
    n_ctx: Mapped[int | None] = mapped_column(Integer)
    parallel: Mapped[int | None] = mapped_column(Integer)
    n_batch: Mapped[int | None] = mapped_column(Integer)
    threads: Mapped[int | None] = mapped_column(Integer)
    gpu_layers: Mapped[int | None] = mapped_column(Integer)
    mode: Mapped[str | None] = mapped_column(String(16))
    # Speculative decoding (SPECULATION_SETTINGS): auto, off or an n-gram type; None means auto. Migration 0013.
    speculation: Mapped[str | None] = mapped_column(String(16))
    # The weights in the page cache while the runner is stopped (WEIGHTS_CHOICES): pinned, warm or cold;
    # None means warm. Migration 0014.
    weights: Mapped[str | None] = mapped_column(String(8))
    # The catalog name of the model that drafts for this one (a smaller model of the same vocabulary, loaded by
    # its runner with -md); None: none. Used while speculation is auto. Migration 0018.
    draft_model: Mapped[str | None] = mapped_column(String(255))
    # KV cache types (app.engine.kv_types: -ctk / -ctv); None means f16, llama.cpp's default. Migration 0020.
    cache_type_k: Mapped[str | None] = mapped_column(String(16))
    cache_type_v: Mapped[str | None] = mapped_column(String(16))
    # Experts kept in RAM: the first N layers' (--n-cpu-moe N), -1 every layer's (--cpu-moe); None: none. The GPUs
    # offloaded layers use (--device "Vulkan0,Vulkan1"; None: all), their shares (--tensor-split "3,1"; None: by
    # free memory), --split-mode (None: layer) and --main-gpu (None: 0). Migration 0020.
    n_cpu_moe: Mapped[int | None] = mapped_column(Integer)
    devices: Mapped[str | None] = mapped_column(String(255))
    tensor_split: Mapped[str | None] = mapped_column(String(255))
    split_mode: Mapped[str | None] = mapped_column(String(8))
    main_gpu: Mapped[int | None] = mapped_column(Integer)


class Node(Base):
    """A remote OpenAI-compatible runner that also serves a model (scale-out)."""

    __tablename__ = "nodes"
    __table_args__ = (UniqueConstraint("model_id", "url"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(Text)
    label: Mapped[str | None] = mapped_column(String(128))
    enabled: Mapped[bool] = mapped_column(Boolean, default=True, server_default=text("1"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ResidencyEvent(Base):
    """A load, unload, eviction, crash, failed load or restart of a model on a runner."""

    __tablename__ = "residency_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    model_name: Mapped[str] = mapped_column(String(255))
    # The node's label or URL; None for this box's own runner.
    node: Mapped[str | None] = mapped_column(Text)
    event: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    cold_start_ms: Mapped[float | None] = mapped_column(Float)
    estimate_bytes: Mapped[int | None] = mapped_column(BigInteger)
    measured_bytes: Mapped[int | None] = mapped_column(BigInteger)
    pid: Mapped[int | None] = mapped_column(Integer)
    # A load's split (migration 0014), in ms; None where it was not measured (a stock llama-server tells
    # only cold_start_ms; upload without GPU layers; the first prefill until a request came).
    load_read_ms: Mapped[float | None] = mapped_column(Float)
    load_context_ms: Mapped[float | None] = mapped_column(Float)
    load_upload_ms: Mapped[float | None] = mapped_column(Float)
    load_restore_ms: Mapped[float | None] = mapped_column(Float)
    first_prefill_ms: Mapped[float | None] = mapped_column(Float)
    # Where the weights came from (page_cache | disk, from the file's share in the page cache just before
    # the load) and the KV the first request got back (ram | disk | none).
    weights_source: Mapped[str | None] = mapped_column(String(16))
    kv_source: Mapped[str | None] = mapped_column(String(8))


class RequestClass(Base):
    """A request class: priority, latency targets, token and admission limits, fair-share weight."""

    __tablename__ = "request_classes"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    priority: Mapped[int] = mapped_column(Integer)
    ttft_target_ms: Mapped[int] = mapped_column(Integer)
    tpot_target_ms: Mapped[int] = mapped_column(Integer)
    default_max_tokens: Mapped[int] = mapped_column(Integer)
    max_output_tokens: Mapped[int] = mapped_column(Integer)
    max_concurrent: Mapped[int] = mapped_column(Integer)
    max_queue: Mapped[int] = mapped_column(Integer)
    weight: Mapped[float] = mapped_column(Float)
    preemptible: Mapped[bool] = mapped_column(Boolean)
    queue_timeout_s: Mapped[float] = mapped_column(Float)
    # A model name or alias; None means the request must name its model.
    default_model: Mapped[str | None] = mapped_column(String(255))
    # Thinking for a request that does not say (app.policy.THINKING_MODES): model, off, on. Migration 0012.
    thinking: Mapped[str] = mapped_column(String(8), default="model", server_default="model")
    # Whether the class's requests may draft (speculative decoding, where the runner decides it pays); off
    # sends the runner "speculative.n_max": 0 with each request. Migration 0013.
    speculation: Mapped[bool] = mapped_column(Boolean, default=True, server_default=text("1"))
    # A private class's prompts stay in the runner's memory (KV cache, RAM tier) and are never written to the KV
    # disk tier, so nothing of them outlives the runner on the data volume. Migration 0019.
    private: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("0"))


class Member(Base):
    """A person or app of the household that owns API tokens, with limits of its own beside the class limits.

    A person behind a token trusted to name its users (Open WebUI's X-OpenWebUI-User-* headers) is a
    member too, created on first sight with `parent_id` the token's member and `external_id` the id
    the client gave: limits, the request log and the dashboard then treat them as anyone else.
    A limit left None means the default: running places and queue, a share of each class
    (setting member_class_share); rates, the member_max_* settings (none by default). Migration 0011.
    """

    __tablename__ = "members"
    __table_args__ = (UniqueConstraint("parent_id", "external_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("members.id", ondelete="CASCADE"), index=True)
    external_id: Mapped[str | None] = mapped_column(String(128))
    # Per class: places a member may hold running and waiting in any one class (capped by the class's own).
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    max_queue: Mapped[int | None] = mapped_column(Integer)
    # Across classes: requests admitted per minute, prompt + completion tokens per minute and per day.
    max_requests_per_min: Mapped[int | None] = mapped_column(Integer)
    max_tokens_per_min: Mapped[int | None] = mapped_column(Integer)
    max_tokens_per_day: Mapped[int | None] = mapped_column(Integer)


class ApiToken(Base):
    """An API token, stored as its SHA-256 hash; the prefix alone is kept readable for lists."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    member_id: Mapped[int] = mapped_column(ForeignKey("members.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(12))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    default_class: Mapped[str] = mapped_column(String(64))
    allowed_classes: Mapped[list[str]] = mapped_column(JSON, default=list, server_default="[]")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column()
    last_used_at: Mapped[datetime | None] = mapped_column()
    # May pull, delete, copy (alias) and load/unload models through the API while api_manage_models is
    # on; off for every token made before migration 0011 until the admin grants it.
    may_manage: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("0"))
    # Its X-OpenWebUI-User-* headers name the person behind each request (see Member).
    trust_user_headers: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("0"))


class RequestRecord(Base):
    """One finished, failed, cancelled, timed-out or rejected API request and its timings."""

    __tablename__ = "requests"
    __table_args__ = (
        Index("ix_requests_class_name_arrival_at", "class_name", "arrival_at"),
        # Covers the dashboard's latency percentiles over a time range (migrations 0005, 0006, 0010).
        Index("ix_requests_latency", "arrival_at", "status", "class_name", "ttft_ms", "tpot_ms", "queue_ms",
              "completion_tokens", "ttft_kind"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    arrival_at: Mapped[datetime] = mapped_column(index=True)
    member_name: Mapped[str | None] = mapped_column(String(128))
    # Not a foreign key: the log outlives the token.
    token_id: Mapped[int | None] = mapped_column(Integer)
    class_name: Mapped[str | None] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(255))
    runner: Mapped[str | None] = mapped_column(Text)
    stream: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("0"))
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    # Of prompt_tokens, those the runner's prefix cache served (migration 0007).
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    queue_ms: Mapped[float | None] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    ttft_kind: Mapped[str | None] = mapped_column(String(16))  # one of TTFT_KINDS; NULL with no ttft_ms (0010)
    tpot_ms: Mapped[float | None] = mapped_column(Float)
    total_ms: Mapped[float | None] = mapped_column(Float)
    num_preemptions: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    queue_position: Mapped[int | None] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    http_status: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    # What the request used beyond plain generation, comma-separated (FEATURES in app.protocols.openai); migration 0007.
    features: Mapped[str | None] = mapped_column(String(64))
    # Speculative decoding: draft tokens the runner verified for the request and those it kept (its final
    # timings' draft_n and draft_n_accepted); NULL when it did not draft. Migration 0013.
    draft_tokens: Mapped[int | None] = mapped_column(Integer)
    draft_accepted: Mapped[int | None] = mapped_column(Integer)
    # Images in the prompt and the time the runner's projector spent encoding them (its final timings'
    # num_images and image_encode_ms); NULL for a request without images. Migration 0017.
    images: Mapped[int | None] = mapped_column(Integer)
    image_encode_ms: Mapped[float | None] = mapped_column(Float)
    # A transcription's audio length in seconds (the file's own); NULL for other requests. Migration 0021.
    # Speech out (features "speech"): the audio it wrote, in seconds, is audio_seconds; ttft_ms is its time to first
    # audio. A transcription's audio_seconds is its file's length.
    audio_seconds: Mapped[float | None] = mapped_column(Float)
    # The characters a speech request spoke; NULL for other requests. Migration 0022.
    input_chars: Mapped[int | None] = mapped_column(Integer)


class Refusal(Base):
    """Requests refused at admission (429), counted per minute, member, class and reason instead of one row each.

    A flood of refusals must not grow the store by a row per request: the gateway counts them in
    memory and adds each minute's counts here (an upsert), so a minute of any flood is one row per
    member, class and reason. Migration 0011.
    """

    __tablename__ = "refusals"
    __table_args__ = {"sqlite_with_rowid": False}

    bucket: Mapped[int] = mapped_column(Integer, primary_key=True)  # minute start, Unix seconds, UTC
    member_name: Mapped[str] = mapped_column(String(128), primary_key=True)
    class_name: Mapped[str] = mapped_column(String(64), primary_key=True)
    reason: Mapped[str] = mapped_column(String(32), primary_key=True)  # one of REFUSAL_REASONS (app.gateway.refusals)
    count: Mapped[int] = mapped_column(Integer)


class Setting(Base):
    """A setting edited on the dashboard: a JSON value under a key."""

    __tablename__ = "settings"

    key: Mapped[str] = mapped_column(String(128), primary_key=True)
    value: Mapped[Any] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


# Telemetry time series. Size math for the target (30 days of samples + 100k requests <= 300 MB):
# a box with 2 runners and 1 GPU writes 22 values a second (host 3, GPU 5, runner 7 each), 1.9 M a
# day. A narrow row carrying source and metric as text and `at` as a datetime string costs ~150
# bytes with its index (~280 MB a day), so instead source and metric live once in `series`, and a
# sample is (series_id, at as Unix seconds, value) in a WITHOUT ROWID table keyed by (series_id,
# at): the key is the range index. Measured (22 series x 6 h, VACUUMed, dbstat): 15.4 bytes a
# sample, 27.4 a rollup row. So ~29 MB a day of samples, ~59 MB for the default 48 h retention
# (~205 MB if raised to 7 days); minute rows for 30 days ~26 MB; hourly rows for 365 days ~5 MB;
# 100k request rows ~20 MB. Total ~110 MB at the defaults. Narrow rather than one wide row per
# source: a new metric is a new `series` row, not a migration, and metric metadata stays data
# (app.telemetry.sampler.METRICS). Times are integer Unix seconds here, not UTCDateTime: 4 bytes
# against 26 in the largest table of the store.


class Series(Base):
    """One time series: where it comes from ('host', 'gpu:<i>', 'runner:<model>@<node>') and what it measures."""

    __tablename__ = "series"
    __table_args__ = (UniqueConstraint("source", "metric"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    source: Mapped[str] = mapped_column(String(255))
    metric: Mapped[str] = mapped_column(String(64))


class Sample(Base):
    """One 1-second value of a series, kept for the `samples_retention_h` window."""

    __tablename__ = "samples"
    __table_args__ = {"sqlite_with_rowid": False}

    series_id: Mapped[int] = mapped_column(ForeignKey("series.id", ondelete="CASCADE"), primary_key=True)
    at: Mapped[int] = mapped_column(Integer, primary_key=True)  # Unix seconds, UTC
    value: Mapped[float] = mapped_column(Float)


class _RollupColumns:
    """The columns shared by the rollup tables: a bucket of one series summarised."""

    series_id: Mapped[int] = mapped_column(ForeignKey("series.id", ondelete="CASCADE"), primary_key=True)
    bucket: Mapped[int] = mapped_column(Integer, primary_key=True)  # bucket start, Unix seconds, UTC
    min: Mapped[float] = mapped_column(Float)
    max: Mapped[float] = mapped_column(Float)
    # Sum and count rather than a mean: hourly rows are then exact sums of minute rows.
    sum: Mapped[float] = mapped_column(Float)
    count: Mapped[int] = mapped_column(Integer)


class Rollup1m(_RollupColumns, Base):
    """One minute of one series."""

    __tablename__ = "rollups_1m"
    __table_args__ = {"sqlite_with_rowid": False}


class Rollup1h(_RollupColumns, Base):
    """One hour of one series, built from its minute rows."""

    __tablename__ = "rollups_1h"
    __table_args__ = {"sqlite_with_rowid": False}


# Bench: one `hearth bench replay` is a session of runs (target × mode × level); every request a
# run sent is kept as raw evidence, so a run's summary can be recomputed from its rows at any time.


class BenchSession(Base):
    """One replay: scenario, what was held constant, the verdict, and its progress."""

    __tablename__ = "bench_sessions"

    id: Mapped[int] = mapped_column(primary_key=True)
    started_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    finished_at: Mapped[datetime | None] = mapped_column()
    scenario: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16), default="running", server_default="running")
    model_name: Mapped[str | None] = mapped_column(String(255))
    constants: Mapped[Any] = mapped_column(JSON, default=dict, server_default="{}")
    verdict: Mapped[Any | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)


class BenchRun(Base):
    """One target × mode × overlap level of a session, with the runner samples taken during it."""

    __tablename__ = "bench_runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    session_id: Mapped[int] = mapped_column(ForeignKey("bench_sessions.id", ondelete="CASCADE"), index=True)
    target: Mapped[str] = mapped_column(String(64))
    mode: Mapped[str] = mapped_column(String(32))
    level: Mapped[int] = mapped_column(Integer)
    # The runner's sequence slots (parallel) during the run; None when unknown (an external target).
    slots: Mapped[int | None] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    wall_s: Mapped[float] = mapped_column(Float)
    # Runner /metrics and utilisation samples: [{t_s, kv_used, kv_total, running, waiting, ...}].
    samples: Mapped[Any] = mapped_column(JSON, default=list, server_default="[]")
    summary: Mapped[Any] = mapped_column(JSON, default=dict, server_default="{}")


class BenchRequest(Base):
    """One request of a run as the client saw it (seconds from the run's start) and as the server reported it."""

    __tablename__ = "bench_requests"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("bench_runs.id", ondelete="CASCADE"), index=True)
    idx: Mapped[int] = mapped_column(Integer)
    class_name: Mapped[str] = mapped_column(String(64))
    priority: Mapped[int] = mapped_column(Integer)
    sent_s: Mapped[float] = mapped_column(Float)
    first_token_s: Mapped[float | None] = mapped_column(Float)
    end_s: Mapped[float | None] = mapped_column(Float)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    max_tokens: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text)
    # The server's own timings for the request (the hearth runner's RequestStats, llama-server's `timings`).
    server_timings: Mapped[Any | None] = mapped_column(JSON)


class BenchApplied(Base):
    """A recommendation an admin applied: who, what changed, when, and the evidence it rested on."""

    __tablename__ = "bench_applied"

    id: Mapped[int] = mapped_column(primary_key=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    applied_by: Mapped[str] = mapped_column(String(128))
    session_id: Mapped[int | None] = mapped_column(ForeignKey("bench_sessions.id", ondelete="SET NULL"))
    model_name: Mapped[str] = mapped_column(String(255))
    recommendation: Mapped[Any] = mapped_column(JSON)
    # {field: [before, after]} on the model's runner_settings row.
    changes: Mapped[Any] = mapped_column(JSON)


# Which days a preload schedule entry acts on (the local calendar of the box).
PRELOAD_DAYS = ("daily", "weekdays", "weekends")


class PreloadEntry(Base):
    """A time-of-day preload the admin applied: load `model_name` at `at_minute` (local time) on `days`.

    The window and the evidence are the recommendation's own (app.services.preload), kept so the schedule
    still says why after the request log has moved on. Migration 0015.
    """

    __tablename__ = "preload_schedule"
    __table_args__ = (
        UniqueConstraint("model_name", "days", "at_minute"),
        CheckConstraint(_one_of("days", PRELOAD_DAYS), name="days"),
        CheckConstraint("at_minute >= 0 AND at_minute < 1440", name="at_minute"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_name: Mapped[str] = mapped_column(String(255))
    days: Mapped[str] = mapped_column(String(16))
    # Minutes after local midnight.
    at_minute: Mapped[int] = mapped_column(Integer)
    window_start_minute: Mapped[int] = mapped_column(Integer)
    window_end_minute: Mapped[int] = mapped_column(Integer)
    evidence: Mapped[str] = mapped_column(Text)
    applied_by: Mapped[str] = mapped_column(String(128))
    applied_at: Mapped[datetime] = mapped_column(default=utcnow)
