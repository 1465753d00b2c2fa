"""Prometheus exposition for a runner: llama-server's `llamacpp:` names plus Hearth's own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from app.engine.engine import Engine
from app.engine.kv_tiers import TierCounters
from app.engine.request import RequestStats
from app.exposition import TPOT_BUCKETS_S, TTFT_BUCKETS_S

# llama-server exports no *_created series; neither do we.
disable_created_metrics()



def counter(name: str, doc: str, value) -> CounterMetricFamily:
    """A counter of one unlabelled value."""
    m = CounterMetricFamily(name, doc)
    m.add_metric([], value)
    return m


def gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    """A gauge of one unlabelled value."""
    return GaugeMetricFamily(name, doc, value=value)


def device_buffer(name: str) -> bool:
    """Whether a llama.cpp buffer type is a device's own memory ("Vulkan0", "CUDA0"), not host memory ("CPU",
    "CPU_Mapped", "Vulkan_Host", "CUDA_Host")."""
    return not name.startswith("CPU") and not name.endswith("_Host")


class _EngineCollector:
    """Reads the engine's counters and snapshot at scrape time; never drives the engine."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.n_tokens_max = 0  # the longest finished sequence (prompt + output), llama-server's n_tokens_max

    def collect(self):
        """Every metric, read now: llama-server's, then the engine's scheduling, then its prefix cache."""
        snap = self.engine.snapshot()
        yield from self._llama_server(snap)
        yield from self._scheduling(snap)
        yield from self._prefix_cache(snap)
        yield from self._tiers()
        if self.engine.media is not None:
            yield from self._images(self.engine.media)
        yield from self._devices()

    def _devices(self):
        """The bytes llama.cpp allocated on each device for this runner (its own buffer sizes, as logged at load): the
        device's memory in use where its driver does not report it (lavapipe), and what evicting the runner frees."""
        buffers = getattr(self.engine.model, "buffers", None) or {}
        family = GaugeMetricFamily("hearth:device_buffer_bytes", "Bytes of llama.cpp buffers on a device (model, "
                                   "KV, compute) for this runner", labels=["device"])
        for name, parts in buffers.items():
            if device_buffer(name):
                family.add_metric([name], float(sum(parts.values())))
        yield family

    def _llama_server(self, snap):
        """llama-server's `llamacpp:` names."""
        c = snap.counters
        yield counter("llamacpp:prompt_tokens", "Number of prompt tokens processed", c.prompt_tokens_total)
        yield counter("llamacpp:prompt_tokens_cached", "Number of prompt tokens served from the cache",
                      snap.prefix_cache_counters.hit_tokens_total)
        yield counter("llamacpp:prompt_seconds", "Total time spent processing prompts", c.prompt_seconds_total)
        yield counter("llamacpp:tokens_predicted", "Number of generation tokens processed", c.tokens_predicted_total)
        yield counter(
            "llamacpp:tokens_predicted_seconds", "Total time spent generating tokens", c.tokens_predicted_seconds_total
        )
        yield counter("llamacpp:n_decode", "Total number of llama_decode() calls", c.decode_calls_total)
        # llama-server exports this counter without the _total suffix that CounterMetricFamily would add.
        peak = Metric("llamacpp:n_tokens_max", "Largest observed n_tokens", "counter")
        peak.add_sample("llamacpp:n_tokens_max", {}, self.n_tokens_max)
        yield peak
        yield counter("llamacpp:spec_decode_num_draft_tokens", "Speculative: Total draft tokens generated",
                      c.spec_draft_tokens_total)
        yield counter("llamacpp:spec_decode_num_accepted_tokens",
                      "Speculative: Total draft tokens accepted by the target model", c.spec_accepted_tokens_total)
        yield counter("llamacpp:spec_decode_num_drafts", "Speculative: Total speculative decoding verification steps",
                      c.spec_drafts_total)
        if c.spec_accepted_per_pos:
            per_pos = CounterMetricFamily("llamacpp:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens per draft position", labels=["position"])
            for i, n in enumerate(list(c.spec_accepted_per_pos)):
                per_pos.add_metric([str(i)], n)
            yield per_pos
        yield gauge(
            "llamacpp:prompt_tokens_seconds",
            "Average prompt throughput in tokens/s",
            c.prompt_tokens_total / c.prompt_seconds_total if c.prompt_seconds_total else 0.0,
        )
        yield gauge(
            "llamacpp:predicted_tokens_seconds",
            "Average generation throughput in tokens/s",
            c.tokens_predicted_total / c.tokens_predicted_seconds_total if c.tokens_predicted_seconds_total else 0.0,
        )
        yield gauge("llamacpp:requests_processing", "Number of requests processing", snap.num_running)
        yield gauge("llamacpp:requests_deferred", "Number of requests deferred", snap.num_waiting)
        yield gauge(
            "llamacpp:n_busy_slots_per_decode",
            "Average number of busy slots per llama_decode() call",
            c.busy_slots_total / max(c.iterations_total, 1),
        )
        yield gauge("llamacpp:kv_cache_tokens", "KV cache tokens in use", snap.kv_used)
        yield gauge(
            "llamacpp:kv_cache_usage_ratio",
            "KV cache usage (1 = full)",
            snap.kv_used / snap.kv_total if snap.kv_total else 0.0,
        )

    def _scheduling(self, snap):
        """Hearth's KV, slot, preemption and SLO-budget figures."""
        c = snap.counters
        yield gauge("hearth:kv_cells_used", "KV cache cells held by running sequences", snap.kv_used)
        yield gauge("hearth:kv_cells_total", "KV cache cells in the unified cache", snap.kv_total)
        yield counter("hearth:preemptions", "Sequences evicted from the KV cache for recompute", c.preemptions_total)
        yield counter("hearth:held_seconds", "Seconds this runner paused its preemptible work while another local "
                      "runner served a more urgent request (serve's runner_core_yield)", c.held_seconds_total)
        by_class = CounterMetricFamily(
            "hearth:preemptions_by_class",
            "Sequences preempted, by class and reason (slot: a more urgent request took it; kv: the cache was full)",
            labels=["class", "reason"],
        )
        for (name, reason), n in sorted((snap.preemptions_by_class or {}).items()):
            by_class.add_metric([name, reason], n)
        yield by_class
        yield gauge("hearth:requests_running", "Requests holding a sequence slot", snap.num_running)
        yield gauge("hearth:requests_waiting", "Requests waiting for admission", snap.num_waiting)
        yield gauge("hearth:slots_total", "Sequence slots (parallel)", snap.n_seq_max)
        yield from self._budget(snap)
        finished = CounterMetricFamily("hearth:requests_finished", "Requests finished, by reason", labels=["reason"])
        for reason, n in sorted(c.requests_finished.items()):
            finished.add_metric([reason], n)
        yield finished
        yield counter("hearth:iterations", "Engine iterations", c.iterations_total)
        yield from self._speculation(snap)

    def _budget(self, snap):
        """The per-iteration token budget, the fitted iteration costs and what the SLO budget can reach."""
        yield gauge("hearth:token_budget", "Tokens per iteration at most (n_batch or --budget)", snap.token_budget)
        yield gauge("hearth:prefill_budget", "Prefill tokens the last iteration allowed (the SLO budget)",
                    snap.prefill_budget)
        yield gauge("hearth:budget_tpot_target_seconds",
                    "The tightest TPOT target among decoding sequences the budget followed (0: none)",
                    (snap.tightest_tpot_ms or 0) / 1000)
        cost = snap.cost or {}
        yield gauge("hearth:iteration_base_seconds", "Fitted fixed cost of an iteration", cost.get("base_ms", 0) / 1000)
        yield gauge("hearth:decode_token_seconds", "Fitted cost of one decode token in an iteration",
                    cost.get("decode_ms_per_token", 0) / 1000)
        yield gauge("hearth:prefill_token_seconds", "Fitted cost of one prefill token in an iteration",
                    cost.get("prefill_ms_per_token", 0) / 1000)
        feasible = snap.feasibility or {}
        yield gauge("hearth:prefill_knee_tokens",
                    "Prompt tokens per iteration past which a bigger chunk is no cheaper per token (measured)",
                    feasible.get("knee_tokens", 0))
        yield gauge("hearth:prefill_knee_measured", "1 once chunk costs were measured (before: the default knee)",
                    1 if feasible.get("measured_knee") else 0)
        # Until the fit has seen enough warm iterations its paces are the prior's: 0 says "measuring".
        measured = bool(feasible.get("pace_measured"))
        yield gauge("hearth:full_batch_tpot_seconds",
                    "The TPOT a full batch keeps while prompts prefill at the knee: tighter targets are out of reach "
                    "(0: measuring)", feasible.get("full_batch_tpot_ms", 0) / 1000 if measured else 0)
        yield gauge("hearth:full_batch_decode_seconds",
                    "A token every this often while every slot decodes: the median of recent full decode-only iterations' periods, the fit until enough were seen (0: measuring)",
                    feasible.get("full_batch_decode_ms", 0) / 1000 if measured else 0)
        yield gauge("hearth:budget_reachable_tpot_seconds",
                    "The pace the last budgeted iteration kept instead of an out-of-reach target (0: in reach)",
                    (feasible.get("reachable_tpot_ms") or 0) / 1000)

    def _speculation(self, snap):
        """Speculative decoding's draft tokens verified and kept, by class, and whether it drafts now."""
        c = snap.counters
        drafted = CounterMetricFamily("hearth:spec_draft_tokens_by_class",
                                      "Speculative: draft tokens verified, by class", labels=["class"])
        accepted = CounterMetricFamily("hearth:spec_accepted_tokens_by_class",
                                       "Speculative: draft tokens kept, by class", labels=["class"])
        for name, (_, n_draft, n_kept) in sorted(dict(c.spec_by_class).items()):
            drafted.add_metric([name], n_draft)
            accepted.add_metric([name], n_kept)
        yield drafted
        yield accepted
        yield from self._spec_rule(snap)
        yield gauge("hearth:spec_enabled", "Speculative decoding configured (1) or not (0)", 1 if snap.spec else 0)
        yield gauge("hearth:spec_drafting", "Whether the last iteration drafted (1), or stood aside (0)",
                    1 if snap.spec and snap.last_iteration and snap.last_iteration.num_draft_tokens else 0)

    def _spec_rule(self, snap):
        """The cost rule per draft source (app/engine/speculation.py decide): decisions, acceptance, the last one."""
        decisions = CounterMetricFamily("hearth:spec_source_decisions", "Speculative: the cost rule's decisions "
                                        "per draft source (draft, cut, explore)", labels=["source", "decision"])
        acceptance = GaugeMetricFamily("hearth:spec_source_acceptance",
                                       "Speculative: a draft source's estimated per-token acceptance", labels=["source"])
        kept = GaugeMetricFamily("hearth:spec_source_kept_tokens", "Speculative: tokens the source's best draft length "
                                 "keeps on average, at its last decision", labels=["source"])
        cost = GaugeMetricFamily("hearth:spec_source_cost_tokens", "Speculative: plain tokens the time of verifying "
                                 "that length would have decoded, at its last decision", labels=["source"])
        length = GaugeMetricFamily("hearth:spec_source_draft_length", "Speculative: draft tokens sent at the source's "
                                   "last decision (0: cut)", labels=["source"])
        for name, src in sorted((snap.spec_sources or {}).items()):
            for kind, n in src["decisions"].items():
                decisions.add_metric([name, kind], n)
            acceptance.add_metric([name], src["acceptance_estimate"])
            last = src["last"] or {}
            kept.add_metric([name], last.get("kept_tokens", 0))
            cost.add_metric([name], last.get("cost_tokens", 0))
            length.add_metric([name], last.get("length", 0))
        yield from (decisions, acceptance, kept, cost, length)

    def _images(self, media):
        """Images evaluated (not those reused from the prefix cache), their encode time by class, the KV pause."""
        images = CounterMetricFamily("hearth:images", "Images encoded and evaluated into the KV cache",
                                     labels=["class"])
        encode = CounterMetricFamily("hearth:image_encode_seconds",
                                     "Time the projector spent encoding images (off the engine thread)",
                                     labels=["class"])
        with media.lock:
            by_class = dict(media.images_by_class)
            encode_by_class = dict(media.encode_ms_by_class)
            decode_s, longest_ms = media.decode_seconds_total, media.max_decode_ms
        for name, n in by_class.items():
            images.add_metric([name], n)
            encode.add_metric([name], encode_by_class.get(name, 0.0) / 1000)
        yield images
        yield encode
        yield counter("hearth:image_kv_decode_seconds",
                      "Engine-thread time spent evaluating image embeddings into the KV cache (others wait)", decode_s)
        yield gauge("hearth:image_kv_decode_longest_ms", "The longest single image evaluation so far", longest_ms)

    def _prefix_cache(self, snap):
        """The prefix cache's use, and the last iteration's time outside llama_decode."""
        pc = snap.prefix_cache_counters
        yield gauge("hearth:kv_cells_cached", "KV cache cells held only by the prefix cache (evictable)", snap.kv_cached)
        yield counter("hearth:prefix_cache_query_tokens",
                      "Prompt tokens of admitted requests, once each (looked up in the prefix cache unless cache_prompt "
                      "was false)", pc.query_tokens_total)
        yield counter("hearth:prefix_cache_hit_tokens",
                      "Prompt tokens not computed: served from the KV cache or restored from a tier (cached_tokens)",
                      pc.hit_tokens_total)
        restored = CounterMetricFamily(
            "hearth:prefix_cache_restored_tokens",
            "Of the hit tokens, those a KV tier restored at the request's first admission (hit minus these: the KV cache)",
            labels=["tier"])
        restored.add_metric(["ram"], pc.restored_tokens_total - pc.disk_restored_tokens_total)
        restored.add_metric(["disk"], pc.disk_restored_tokens_total)
        yield restored
        yield counter("hearth:prefix_cache_evictions", "Cached prefixes evicted to make room", pc.evictions_total)
        yield gauge("hearth:prefix_cache_entries", "Cached prefixes (leaves of the radix tree)", snap.prefix_cache_entries)
        last = snap.last_iteration
        yield gauge(
            "hearth:last_iteration_outside_decode_ratio",
            "Share of the last iteration spent outside llama_decode",
            last.outside_decode_ms / last.iteration_ms if last and last.iteration_ms else 0.0,
        )


    def _tiers(self):
        """The KV tiers below the KV cache: hits, bytes held, save and restore time (all 0 when off)."""
        tiers = self.engine.tiers
        c = tiers.counters if tiers is not None else TierCounters()
        # `is not None`, not truth: a disk tier with no entry yet has a length of 0, and its counters still count.
        disk = tiers.disk if tiers is not None else None
        ram_hits = c.hits_total - c.disk_hits_total
        for name, doc, ram, on_disk in (
            ("hearth:kv_tier_hits", "Admissions that got KV cells back from a tier instead of prefilling them",
             ram_hits, c.disk_hits_total),
            ("hearth:kv_tier_restored_tokens", "Prompt tokens restored from a tier instead of prefilled",
             c.restored_tokens_total - c.disk_restored_tokens_total, c.disk_restored_tokens_total),
            ("hearth:kv_tier_saves", "Prefix-cache entries written to a tier",
             c.saves_total, disk.num_written if disk is not None else 0),
            ("hearth:kv_tier_dropped", "Entries a tier dropped to stay within its budget",
             c.dropped_total, disk.num_dropped if disk is not None else 0),
            ("hearth:kv_tier_unreadable", "Entries dropped as unreadable, truncated or corrupted (prefilled instead)",
             c.failures_total, disk.num_bad if disk is not None else 0),
        ):
            m = CounterMetricFamily(name, doc, labels=["tier"])
            m.add_metric(["ram"], ram)
            m.add_metric(["disk"], on_disk)
            yield m
        yield counter("hearth:kv_tier_disk_write_failures", "Disk tier writes that failed (a full disk): the entry stays in RAM",
                      disk.num_failed_writes if disk is not None else 0)
        yield counter("hearth:kv_tier_restore_seconds", "Time spent restoring KV cells from the tiers (disk reads included)",
                      c.restore_seconds_total + c.disk_read_seconds_total)
        yield counter("hearth:kv_tier_disk_read_seconds", "Time spent reading and checking disk tier entries",
                      c.disk_read_seconds_total)
        yield counter("hearth:kv_tier_save_seconds", "Time the engine spent copying KV cells out for the tiers",
                      c.save_seconds_total)
        held = GaugeMetricFamily("hearth:kv_tier_bytes", "Bytes of KV state a tier holds", labels=["tier"])
        held.add_metric(["ram"], tiers.num_bytes if tiers is not None else 0)
        held.add_metric(["disk"], disk.num_bytes if disk is not None else 0)
        yield held
        budget = GaugeMetricFamily("hearth:kv_tier_budget_bytes",
                                   "Bytes a tier may hold (--cache-ram, --cache-disk-mib): -1 no limit, 0 off", labels=["tier"])
        budget.add_metric(["ram"], _budget(tiers.ram.max_bytes) if tiers is not None else 0)
        budget.add_metric(["disk"], _budget(disk.max_bytes) if disk is not None else 0)
        yield budget
        entries = GaugeMetricFamily("hearth:kv_tier_entries", "Saved prefixes a tier holds", labels=["tier"])
        entries.add_metric(["ram"], len(tiers.ram) if tiers is not None else 0)
        entries.add_metric(["disk"], len(disk) if disk is not None else 0)
        yield entries


def _budget(max_bytes: int | None) -> int:
    """A tier's byte budget for /metrics: -1 for no limit."""
    return -1 if max_bytes is None else max_bytes


class RunnerMetrics:
    """A registry per runner: engine gauges/counters plus TTFT and TPOT histograms per class."""

    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = _EngineCollector(engine)
        self.registry.register(self.collector)
        self.ttft = Histogram(
            "hearth:ttft_seconds", "Time to first token", ["class"], buckets=TTFT_BUCKETS_S, registry=self.registry
        )
        self.tpot = Histogram(
            "hearth:tpot_seconds", "Time per output token after the first", ["class"],
            buckets=TPOT_BUCKETS_S, registry=self.registry,
        )
        engine.finished_listeners.append(self.observe)

    def observe(self, stats: RequestStats) -> None:
        """Record a finished request's TTFT and TPOT."""
        n_tokens = stats.num_prompt_tokens + stats.num_completion_tokens
        self.collector.n_tokens_max = max(self.collector.n_tokens_max, n_tokens)
        if stats.ttft_ms is not None:
            self.ttft.labels(stats.class_name).observe(stats.ttft_ms / 1000)
        if stats.tpot_ms is not None:
            self.tpot.labels(stats.class_name).observe(stats.tpot_ms / 1000)

    def render(self) -> bytes:
        """Prometheus text exposition."""
        # prometheus_client names a counter's HELP/TYPE lines with _total; llama-server's n_tokens_max has none.
        return generate_latest(self.registry).replace(b"llamacpp:n_tokens_max_total ", b"llamacpp:n_tokens_max ")
