"""Telemetry sampling: collect readings from the host, GPUs and runners, decorate, store.

Called once a second by the `sample_telemetry` job. Each step of `Sampler.sample_all`:

  1. collect: host CPU/RAM (psutil), per GPU (NVML; none is a normal state), the gateway's queue
     depth (admission state, no I/O), and for every ready model's healthy nodes one scrape of
     /metrics and /slots with a short timeout (and, every few seconds, of a drafting hearth
     runner's /props for its speculative decoding decision in words);
  2. decorate: counters become per-second rates against the previous scrape, KV cells become a
     percentage; the metric names and units are the data in METRICS below;
  3. store: one batch of (source, metric, value) readings goes to the store writer, and the
     same batch becomes `latest`, which readers use instead of collecting.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import psutil
from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from app.device_probe import Probe, peek_probe
from app.exposition import parse_exposition
from app.hardware import nvml_gpus, report_nvml_error
from app.residency.manager import ModelState
from app.residency.supervisor import runner_headers
from app.store.models import Sample, Series
from app.store.writer import StoreWriter
from app.telemetry.drm import DrmSampler
from app.telemetry.stream_cost import StreamCost

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 0.5

# A reading: (source, metric, value); sources are 'host', 'gpu:<i>', 'gateway' or 'runner:<model>@<node>'.
Reading = tuple[str, str, float]
HttpGet = Callable[[str, float], str]


@dataclass(frozen=True)
class Metric:
    """What a stored metric means: name, unit and a description for charts and tooltips."""

    name: str
    unit: str
    description: str


METRICS = {
    m.name: m
    for m in [
        Metric("cpu_pct", "%", "host CPU utilisation over the last interval, all cores"),
        Metric("ram_used_bytes", "B", "host memory in use (total minus available)"),
        Metric("ram_total_bytes", "B", "host memory installed"),
        Metric("gpu_util_pct", "%", "share of time a GPU kernel was running"),
        Metric("vram_used_bytes", "B", "GPU memory in use"),
        Metric("vram_total_bytes", "B", "GPU memory installed"),
        Metric("gpu_temp_c", "°C", "GPU core temperature"),
        Metric("gpu_power_w", "W", "GPU power draw"),
        Metric("gen_tok_s", "tok/s", "tokens generated per second"),
        Metric("prompt_tok_s", "tok/s", "prompt tokens processed per second"),
        Metric("prompt_cached_tok_s", "tok/s", "prompt tokens per second served from the prefix cache instead of computed"),
        Metric("prompt_kv_tok_s", "tok/s", "prompt tokens of admitted requests per second served from the KV cache (a prefix hit)"),
        Metric("prompt_ram_tok_s", "tok/s", "prompt tokens of admitted requests per second restored from the RAM tier"),
        Metric("prompt_disk_tok_s", "tok/s", "prompt tokens of admitted requests per second restored from the disk tier"),
        Metric("prompt_computed_tok_s", "tok/s", "prompt tokens of admitted requests per second computed (prefilled); with the three reused parts, the clients' prompt tokens"),
        Metric("kv_tier_ram_bytes", "B", "KV state the RAM tier holds (evicted prefixes kept in host RAM)"),
        Metric("kv_tier_disk_bytes", "B", "KV state the disk tier holds on the data volume"),
        Metric("running", "seqs", "sequences being decoded"),
        Metric("waiting", "seqs", "requests waiting for a slot or KV space"),
        Metric("kv_used_pct", "%", "KV cache cells held by running sequences"),
        Metric("kv_cached_pct", "%", "KV cache cells held only by the prefix cache (evicted when needed)"),
        Metric("preemptions_s", "1/s", "sequences evicted from the KV cache per second"),
        Metric("slots_busy", "slots", "sequence slots processing a request"),
        Metric("prefill_budget", "tokens", "prefill tokens an iteration may carry: the SLO budget of the last iteration"),
        Metric("budget_tpot_ms", "ms", "the tightest TPOT target among decoding sequences the budget followed (0: none)"),
        Metric("prefill_knee", "tokens", "prompt tokens per iteration past which a bigger chunk is no cheaper per token (measured)"),
        Metric("prefill_knee_measured", "0/1", "1 once the runner measured its chunk costs (before: the default knee)"),
        Metric("full_batch_tpot_ms", "ms", "the TPOT a full batch keeps while prompts prefill at the knee: tighter targets are out of reach"),
        Metric("full_batch_decode_ms", "ms", "a token every this often while every slot decodes (measured, fitted until seen)"),
        Metric("prefill_token_ms", "ms", "a prompt token's cost in an iteration (fitted)"),
        Metric("reachable_tpot_ms", "ms", "the pace the budget kept instead of an out-of-reach target (0: every target in reach)"),
        Metric("spec_draft_tok_s", "tok/s", "draft tokens verified per second (speculative decoding)"),
        Metric("spec_accepted_tok_s", "tok/s", "draft tokens kept per second: each one a token without a decode of its own"),
        Metric("spec_drafting", "0/1", "1 when the runner's last iteration drafted, 0 when drafting stood aside"),
        Metric("queue_waiting", "req", "requests waiting in the gateway for admission, all classes"),
        Metric("in_flight", "req", "requests the gateway admitted that have not finished, all classes"),
    ]
}

# Runner exposition names -> stored metric. Counters are stored as per-second rates.
RUNNER_COUNTERS = {
    "llamacpp:tokens_predicted_total": "gen_tok_s",
    "llamacpp:prompt_tokens_total": "prompt_tok_s",
    "hearth:preemptions_total": "preemptions_s",
    "hearth:prefix_cache_hit_tokens_total": "prompt_cached_tok_s",
    "llamacpp:spec_decode_num_draft_tokens_total": "spec_draft_tok_s",
    "llamacpp:spec_decode_num_accepted_tokens_total": "spec_accepted_tok_s",
}
RUNNER_GAUGES = {
    "llamacpp:requests_processing": "running",
    "llamacpp:requests_deferred": "waiting",
    "hearth:prefill_budget": "prefill_budget",
    "hearth:prefill_knee_tokens": "prefill_knee",
    "hearth:prefill_knee_measured": "prefill_knee_measured",
}
# Runner gauges in seconds -> stored metric in ms.
RUNNER_SECONDS = {
    "hearth:budget_tpot_target_seconds": "budget_tpot_ms",
    "hearth:full_batch_tpot_seconds": "full_batch_tpot_ms",
    "hearth:full_batch_decode_seconds": "full_batch_decode_ms",
    "hearth:prefill_token_seconds": "prefill_token_ms",
    "hearth:budget_reachable_tpot_seconds": "reachable_tpot_ms",
}
RUNNER_LABELLED_GAUGES = {
    ("hearth:kv_tier_bytes", "ram"): "kv_tier_ram_bytes",
    ("hearth:kv_tier_bytes", "disk"): "kv_tier_disk_bytes",
}
QUERY_TOKENS = "hearth:prefix_cache_query_tokens_total"
HIT_TOKENS = "hearth:prefix_cache_hit_tokens_total"
RESTORED_TOKENS = "hearth:prefix_cache_restored_tokens_total"
# The hearth runner's KV tiers, read whole from each scrape (counters as totals since the runner started) for
# serve's /metrics and the overview's tier card: name -> (exposition sample, its tier label or None).
TIER_TOTALS = {
    "ram_hits": ("hearth:kv_tier_hits_total", "ram"),
    "disk_hits": ("hearth:kv_tier_hits_total", "disk"),
    "ram_restored_tokens": ("hearth:kv_tier_restored_tokens_total", "ram"),
    "disk_restored_tokens": ("hearth:kv_tier_restored_tokens_total", "disk"),
    "ram_bytes": ("hearth:kv_tier_bytes", "ram"),
    "disk_bytes": ("hearth:kv_tier_bytes", "disk"),
    "ram_entries": ("hearth:kv_tier_entries", "ram"),
    "disk_entries": ("hearth:kv_tier_entries", "disk"),
    "restore_seconds": ("hearth:kv_tier_restore_seconds_total", None),
    "ram_budget_bytes": ("hearth:kv_tier_budget_bytes", "ram"),
    "disk_budget_bytes": ("hearth:kv_tier_budget_bytes", "disk"),
}


def prompt_parts(scrape) -> dict[str, float] | None:
    """A hearth runner's admitted prompt tokens so far, split four ways that add up to them: served from the KV
    cache, restored from the RAM tier, restored from the disk tier, computed. None when the runner does not say
    (a stock llama-server, or a hearth runner from before the restored-tokens counter)."""
    query, hit = scrape.value(QUERY_TOKENS), scrape.value(HIT_TOKENS)
    ram, disk = scrape.value(RESTORED_TOKENS, {"tier": "ram"}), scrape.value(RESTORED_TOKENS, {"tier": "disk"})
    if query is None or hit is None or ram is None or disk is None:
        return None
    # The runner counts each admission's parts together (app/engine/scheduler.py, count_query), so every
    # difference below only grows: a rate of it is never negative.
    return {"prompt_kv_tok_s": hit - ram - disk, "prompt_ram_tok_s": ram, "prompt_disk_tok_s": disk,
            "prompt_computed_tok_s": query - hit}


def tier_totals(scrape) -> dict[str, float] | None:
    """The KV tiers' figures of one scrape (TIER_TOTALS); None when the runner exports none (tiers unknown to it)."""
    if "hearth:kv_tier_hits_total" not in scrape:
        return None
    return {name: scrape.value(sample, {"tier": tier} if tier else None) or 0.0
            for name, (sample, tier) in TIER_TOTALS.items()}


# A hearth runner with speculative decoding configured says so here; only then is /props read for its decision.
SPEC_ENABLED = "hearth:spec_enabled"
SPEC_DRAFTING = "hearth:spec_drafting"
# /props is read at most this often per node: the decision changes every iteration, a sentence every few seconds is plenty.
SPEC_PROPS_EVERY_S = 5.0


# -- collect ---------------------------------------------------------------------------------------


def sample_host(ps: Any = psutil) -> list[Reading]:
    """Host CPU % since the previous call and RAM used/total."""
    vm = ps.virtual_memory()
    # total - available, not psutil's `used`: page cache the kernel can drop is not pressure.
    return [
        ("host", "cpu_pct", float(ps.cpu_percent(interval=None))),
        ("host", "ram_used_bytes", float(vm.total - vm.available)),
        ("host", "ram_total_bytes", float(vm.total)),
    ]


_GPU_PROBES = [
    ("gpu_util_pct", lambda nvml, h: nvml.nvmlDeviceGetUtilizationRates(h).gpu),
    ("vram_used_bytes", lambda nvml, h: nvml.nvmlDeviceGetMemoryInfo(h).used),
    ("vram_total_bytes", lambda nvml, h: nvml.nvmlDeviceGetMemoryInfo(h).total),
    ("gpu_temp_c", lambda nvml, h: nvml.nvmlDeviceGetTemperature(h, 0)),  # 0: NVML_TEMPERATURE_GPU
    ("gpu_power_w", lambda nvml, h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0),  # NVML reports mW
]


def sample_gpus(nvml: Any = None) -> list[Reading]:
    """Utilisation, VRAM, temperature and power per GPU; [] when there is no GPU (a normal state).

    `nvml` is an opened pynvml-like module (tests pass fakes); by default the process's one (app.hardware).
    """
    gpus = nvml_gpus(nvml)
    if gpus is None:
        return []
    module, handles = gpus
    readings: list[Reading] = []
    for i, handle in enumerate(handles):
        source = f"gpu:{i}"
        # Each reading on its own: consumer GPUs refuse some (power) and the rest still count.
        for metric, probe in _GPU_PROBES:
            try:
                readings.append((source, metric, float(probe(module, handle))))
            except Exception as error:  # NVMLError; "not supported" is logged at info, the rest warn (once)
                report_nvml_error(f"telemetry: {source} {metric}", error)
    return readings


def device_readings(held: Mapping[str, float], probe: Probe | None) -> list[Reading]:
    """GPU series from llama.cpp's own buffer sizes, for devices no driver reading covers (lavapipe; a GPU the
    kernel tells nothing of): `gpu:<n>` for device "Vulkan<n>", memory in use = what the runners hold there."""
    totals = {d.name: d.total_bytes for d in probe.devices} if probe is not None else {}
    readings: list[Reading] = []
    for name, used in sorted(held.items()):
        digits = "".join(ch for ch in name if ch.isdigit())
        source = f"gpu:{int(digits) if digits else 0}"
        readings.append((source, "vram_used_bytes", float(used)))
        if totals.get(name):
            readings.append((source, "vram_total_bytes", float(totals[name])))
    return readings


def sample_gateway(snapshot: Mapping[str, Mapping[str, int]]) -> list[Reading]:
    """The gateway's queue depth and requests in flight, all classes together (admission snapshot)."""
    return [
        ("gateway", "queue_waiting", float(sum(c["waiting"] for c in snapshot.values()))),
        ("gateway", "in_flight", float(sum(c["in_flight"] for c in snapshot.values()))),
    ]


class RateTracker:
    """Turns counters into per-second rates against the previous value seen for the same key."""

    def __init__(self) -> None:
        self._previous: dict[tuple[str, str], tuple[float, float]] = {}

    def rate(self, key: tuple[str, str], t: float, value: float) -> float | None:
        """The rate since the previous value; None on the first one, a counter reset or no elapsed time."""
        previous = self._previous.get(key)
        self._previous[key] = (t, value)
        if previous is None:
            return None
        t0, v0 = previous
        # A counter going down means the runner restarted: one missing point beats a negative rate.
        if t <= t0 or value < v0:
            return None
        return (value - v0) / (t - t0)

    def forget_except(self, keys: Iterable[tuple[str, str]]) -> None:
        """Drop state for keys not in `keys` (runners that went away)."""
        keep = set(keys)
        for key in [k for k in self._previous if k not in keep]:
            del self._previous[key]


class ScrapeFailures:
    """Failed /metrics scrapes per (model, node), for serve's /metrics; each failure streak is logged once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Every scraped node starts at 0, so a counter that never moves is told from one that is absent.
        self._totals: dict[tuple[str, str], int] = {}
        self._failing: dict[tuple[str, str], int] = {}

    def attempted(self, model: str, node: str) -> None:
        """A scrape of this node is about to happen."""
        with self._lock:
            self._totals.setdefault((model, node), 0)

    def failed(self, model: str, node: str, url: str, error: Exception) -> None:
        """Count one failure; the first of a streak is a warning, the rest only debug."""
        key = (model, node)
        with self._lock:
            self._totals[key] = self._totals.get(key, 0) + 1
            streak = self._failing[key] = self._failing.get(key, 0) + 1
        if streak == 1:
            log.warning("telemetry: cannot read %s/metrics of %s on %s (until it recovers, further failures are "
                        "only counted, in hearth:runner_scrape_failures_total): %s", url, model, node, error)
        else:
            log.debug("telemetry: %s/metrics still failing (%d in a row): %s", url, streak, error)

    def succeeded(self, model: str, node: str) -> None:
        """End this node's failure streak, if any."""
        with self._lock:
            streak = self._failing.pop((model, node), 0)
        if streak:
            log.info("telemetry: /metrics of %s on %s readable again after %d failed scrapes", model, node, streak)

    def forget_streaks_except(self, keys: Iterable[tuple[str, str]]) -> None:
        """Nodes no longer scraped end their streak (a model unloaded); their totals stay, counters never go back."""
        keep = set(keys)
        with self._lock:
            for key in [k for k in self._failing if k not in keep]:
                del self._failing[key]

    def totals(self) -> dict[tuple[str, str], int]:
        """Failed scrapes so far by (model, node)."""
        with self._lock:
            return dict(self._totals)


class SpeculationNotes:
    """The last speculative block of each drafting hearth runner's /props, by source; read every few seconds."""

    def __init__(self, every_s: float = SPEC_PROPS_EVERY_S) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._blocks: dict[str, dict] = {}
        self._read_at: dict[str, float] = {}

    def due(self, source: str, now: float) -> bool:
        """Whether this node's /props should be read now."""
        with self._lock:
            last = self._read_at.get(source)
        return last is None or now - last >= self.every_s or now < last

    def note(self, source: str, now: float, block: dict | None) -> None:
        """Keep what /props said (None: it said nothing readable; the previous block is dropped)."""
        with self._lock:
            self._read_at[source] = now
            if block is None:
                self._blocks.pop(source, None)
            else:
                self._blocks[source] = block

    def tried(self, source: str, now: float) -> None:
        """A read failed: the previous block stays, the next try waits its turn."""
        with self._lock:
            self._read_at[source] = now

    def forget_except(self, sources: Iterable[str]) -> None:
        """Drop the nodes that no longer draft or are gone."""
        keep = set(sources)
        with self._lock:
            for source in [s for s in self._read_at if s not in keep]:
                self._read_at.pop(source, None)
                self._blocks.pop(source, None)

    def latest(self) -> dict[str, dict]:
        """Source -> the speculative block last read ({enabled, type, n_max, drafting, note, by_class, ...})."""
        with self._lock:
            return dict(self._blocks)


def _speculative_block(body: str) -> dict | None:
    props = json.loads(body)
    block = props.get("speculative") if isinstance(props, dict) else None
    return block if isinstance(block, dict) else None


def _busy_slots(body: str) -> int:
    slots = json.loads(body)
    # llama-server and Hearth's runner say `is_processing`; older llama-server builds say `state`.
    return sum(1 for s in slots if s.get("is_processing", s.get("state", 0) != 0))


def sample_runners(statuses: Iterable[Mapping[str, Any]], http_get: HttpGet, rates: RateTracker,
                   now: float, failures: ScrapeFailures | None = None,
                   speculation: SpeculationNotes | None = None,
                   tiers: dict[str, dict[str, float]] | None = None,
                   device_bytes: dict[str, float] | None = None) -> list[Reading]:
    """Scrape /metrics and /slots of every healthy node of every ready model; failed scrapes are counted and skipped.

    A node whose /metrics says speculative decoding is configured also has its /props read, when due,
    into `speculation` (the decision in words, which /metrics cannot carry). A node with KV tiers has their
    totals put in `tiers`, by source."""
    failures = failures if failures is not None else ScrapeFailures()
    drafting_sources: list[str] = []
    readings: list[Reading] = []
    seen: list[tuple[str, str]] = []
    scraped: list[tuple[str, str]] = []
    for model in statuses:
        if model.get("state") != ModelState.READY:
            continue
        for node in model.get("nodes") or []:
            if not node.get("healthy") or not node.get("url"):
                continue
            url = node["url"].rstrip("/")
            label = node.get("label") or url
            source = f"runner:{model['name']}@{label}"
            scraped.append((model["name"], label))
            failures.attempted(model["name"], label)
            try:
                scrape = parse_exposition(http_get(f"{url}/metrics", SCRAPE_TIMEOUT_S))
            except Exception as error:  # unreachable, an HTTP error status, or text that is no exposition
                failures.failed(model["name"], label, url, error)
                continue
            failures.succeeded(model["name"], label)
            for name, metric in RUNNER_COUNTERS.items():
                value = scrape.value(name)
                if value is not None:
                    seen.append((source, metric))
                    rate = rates.rate((source, metric), now, value)
                    if rate is not None:
                        readings.append((source, metric, rate))
            for metric, value in (prompt_parts(scrape) or {}).items():
                seen.append((source, metric))
                rate = rates.rate((source, metric), now, value)
                if rate is not None:
                    readings.append((source, metric, rate))
            for name, metric in RUNNER_GAUGES.items():
                value = scrape.value(name)
                if value is not None:
                    readings.append((source, metric, value))
            for (name, tier), metric in RUNNER_LABELLED_GAUGES.items():
                value = scrape.value(name, {"tier": tier})
                if value is not None:
                    readings.append((source, metric, value))
            if device_bytes is not None:
                for labels, value in scrape.series("hearth:device_buffer_bytes"):
                    if labels.get("device"):
                        device_bytes[labels["device"]] = device_bytes.get(labels["device"], 0.0) + value
            totals = tier_totals(scrape)
            if tiers is not None and totals is not None:
                tiers[source] = totals
            used, total = scrape.value("hearth:kv_cells_used"), scrape.value("hearth:kv_cells_total")
            if used is not None and total:
                readings.append((source, "kv_used_pct", 100.0 * used / total))
            for name, metric in RUNNER_SECONDS.items():
                value = scrape.value(name)
                if value is not None:
                    readings.append((source, metric, 1000.0 * value))
            cached = scrape.value("hearth:kv_cells_cached")
            if cached is not None and total:
                readings.append((source, "kv_cached_pct", 100.0 * cached / total))
            if scrape.value(SPEC_ENABLED):
                drafting = scrape.value(SPEC_DRAFTING)
                if drafting is not None:
                    readings.append((source, "spec_drafting", drafting))
                drafting_sources.append(source)
                if speculation is not None and speculation.due(source, now):
                    try:
                        speculation.note(source, now, _speculative_block(http_get(f"{url}/props", SCRAPE_TIMEOUT_S)))
                    except Exception as error:  # a runner busy past the timeout: the last note stays a while
                        speculation.tried(source, now)
                        log.debug("telemetry: %s/props: %s", url, error)
            try:
                readings.append((source, "slots_busy", float(_busy_slots(http_get(f"{url}/slots", SCRAPE_TIMEOUT_S)))))
            except Exception as error:  # /slots may be disabled on a plain llama-server
                log.debug("telemetry: %s/slots: %s", url, error)
    rates.forget_except(seen)
    failures.forget_streaks_except(scraped)
    if speculation is not None:
        speculation.forget_except(drafting_sources)
    return readings


# -- store -----------------------------------------------------------------------------------------


def store_readings(session: Session, at: int, readings: Iterable[Reading]) -> int:
    """Insert one second's readings, creating series rows as needed; the caller commits."""
    rows = [r for r in readings if math.isfinite(r[2])]
    if not rows:
        return 0
    # Looked up inside the write transaction every time: an id cached across transactions could
    # name a series row that a rolled-back batch never kept.
    ids = {(s, m): i for i, s, m in session.execute(select(Series.id, Series.source, Series.metric))}
    missing = sorted({(s, m) for s, m, _ in rows} - ids.keys())
    for source, metric in missing:
        ids[(source, metric)] = session.execute(
            insert(Series).values(source=source, metric=metric).returning(Series.id)
        ).scalar_one()
    # OR REPLACE: two job runs landing in the same second keep the later value instead of failing.
    session.execute(
        insert(Sample).prefix_with("OR REPLACE"),
        [{"series_id": ids[(s, m)], "at": at, "value": v} for s, m, v in rows],
    )
    return len(rows)


def _httpx_get() -> HttpGet:
    import httpx

    # One client, so the runners' connections are kept alive between scrapes; made at the first scrape (its SSL
    # context costs ~15 ms, for nothing in an app that never samples).
    clients: list[httpx.Client] = []

    def get(url: str, timeout_s: float) -> str:
        if not clients:
            clients.append(httpx.Client())
        # A runner serve started answers /metrics and /slots only with its key.
        response = clients[0].get(url, timeout=timeout_s, headers=runner_headers(url))
        response.raise_for_status()
        return response.text

    def close() -> None:
        for client in clients:
            client.close()

    get.close = close  # type: ignore[attr-defined]
    return get


class Sampler:
    """The `sample_telemetry` job: one collected batch per call, written through the store writer."""

    def __init__(self, writer: StoreWriter, runner_status: Callable[[], list[dict]],
                 gateway_status: Callable[[], dict[str, dict]], clock: Callable[[], float] = time.time,
                 http_get: HttpGet | None = None, nvml: Any = None, ps: Any = psutil, drm: DrmSampler | None = None):
        self.writer = writer
        # The residency manager's and the admission's status (read only, no I/O).
        self.runner_status = runner_status
        self.gateway_status = gateway_status
        self.clock = clock
        self.http_get = http_get or _httpx_get()
        self.nvml = nvml
        self.ps = ps
        # Intel and AMD GPUs (amdgpu/i915/xe sysfs, DRM fdinfo) feed the same gpu:<i> series where NVML has none.
        self.drm = drm or DrmSampler()
        self.rates = RateTracker()
        self.scrape_failures = ScrapeFailures()
        self.speculation = SpeculationNotes()
        # Readers (status page, overview) use these; they never trigger a collection.
        self.latest: dict[str, dict[str, float]] = {}
        self.latest_at: float | None = None
        # Each runner's KV tier totals from the latest scrape (tier_totals), by source; replaced whole per sample.
        self.tiers: dict[str, dict[str, float]] = {}
        self._tiers_next: dict[str, dict[str, float]] = {}
        # CPU per 1,000 tokens of serve and its runners (app.telemetry.stream_cost), wired in by serve.
        self.stream_cost: StreamCost | None = None
        self._runners_seen: list[dict] = []  # runner_status() as the last collect read it

    def collect(self, now: float) -> list[Reading]:
        """One batch of readings from the host, the GPUs and the runners; `now` dates the counters."""
        gpus = sample_gpus(self.nvml) or self.drm.sample(now)
        readings = sample_host(self.ps) + gpus + sample_gateway(self.gateway_status())
        self._tiers_next = {}
        held: dict[str, float] = {}
        self._runners_seen = self.runner_status()
        readings += sample_runners(self._runners_seen, self.http_get, self.rates, now, self.scrape_failures,
                                   self.speculation, self._tiers_next, held)
        if not gpus:
            readings += device_readings(held, peek_probe())
        return readings

    def sample_all(self) -> int:
        """Collect, keep as `latest`, and queue the batch for the store; returns the number of readings."""
        now = self.clock()
        readings = self.collect(now)
        at = int(now)
        latest: dict[str, dict[str, float]] = {}
        for source, metric, value in readings:
            latest.setdefault(source, {})[metric] = value
        self.latest, self.latest_at, self.tiers = latest, at, self._tiers_next
        if self.stream_cost is not None:
            # The runners this collect scraped: residency is asked once a second, not twice.
            self.stream_cost.sample(m["pid"] for m in self._runners_seen if m.get("pid"))
        self.writer.submit(lambda session: store_readings(session, at, readings))
        return len(readings)

