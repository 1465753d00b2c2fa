"""Prometheus exposition of `hearth serve`: per-class request counters and latency histograms,
residency gauges. Readers never drive collection: gauges read state the services already hold."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from app.exposition import TPOT_BUCKETS_S, TTFT_BUCKETS_S
from app.residency.manager import ModelState
from app.store.writer import LOSS_REASONS
from app.telemetry.sampler import Sampler

QUEUE_BUCKETS_S = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
# An image's encode: tens of ms for a small projector on a GPU, seconds for a 4B model's tower on a NAS CPU
# (a reused image is encoded in 0 s: it falls in the first bucket).
IMAGE_ENCODE_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
# Real-time factors: under 0.1 is a voice assistant's comfort, over 1 is slower than speech.
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)


class _ResidencyCollector:
    """Per-model gauges from the residency manager and per-class admission from the gateway."""

    def __init__(self, runner_status: Callable[[], list[dict]], gateway_status: Callable[[], dict[str, dict]],
                 sampler: Sampler, writer_health: Callable[[], dict],
                 device_status: Callable[[], dict[str, dict]] = dict):
        self.runner_status = runner_status
        self.device_status = device_status
        self.gateway_status = gateway_status
        self.sampler = sampler
        self.writer_health = writer_health

    def collect(self):
        state = GaugeMetricFamily("hearth:model_resident", "1 when the model's local runner is ready", labels=["model"])
        rss = GaugeMetricFamily("hearth:model_rss_bytes", "Resident memory of the model's runner", labels=["model"])
        estimate = GaugeMetricFamily("hearth:model_estimate_bytes", "Estimated memory of the model's runner",
                                     labels=["model"])
        in_flight = GaugeMetricFamily("hearth:model_in_flight", "Requests leased to the model's nodes", labels=["model"])
        for m in self.runner_status():
            name = m["name"]
            state.add_metric([name], 1.0 if m["state"] == ModelState.READY else 0.0)
            rss.add_metric([name], float(m.get("rss_bytes") or 0))
            estimate.add_metric([name], float(m.get("estimate_bytes") or 0))
            in_flight.add_metric([name], float(m.get("in_flight") or 0))
        yield from (state, rss, estimate, in_flight)
        yield from self._devices()
        # KV usage per model and node from the sampler's latest 1-second scrape of each runner.
        kv = GaugeMetricFamily("hearth:model_kv_used_percent", "KV cache cells in use, latest 1-s sample",
                               labels=["model", "node"])
        for source, values in self.sampler.latest.items():
            if source.startswith("runner:") and "kv_used_pct" in values:
                model, _, node = source.removeprefix("runner:").partition("@")
                kv.add_metric([model, node], values["kv_used_pct"])
        yield kv
        yield from self._tiers()
        scrape_failures = CounterMetricFamily(
            "hearth:runner_scrape_failures", "Failed 1-s scrapes of a runner's /metrics (unreachable, error, unreadable)",
            labels=["model", "node"])
        for (model, node), n in sorted(self.sampler.scrape_failures.totals().items()):
            scrape_failures.add_metric([model, node], float(n))
        yield scrape_failures
        waiting = GaugeMetricFamily("hearth:class_waiting", "Requests waiting for admission", labels=["class"])
        running = GaugeMetricFamily("hearth:class_in_flight", "Requests admitted and not finished", labels=["class"])
        for name, snap in self.gateway_status().items():
            waiting.add_metric([name], snap["waiting"])
            running.add_metric([name], snap["in_flight"])
        yield from (waiting, running)
        health = self.writer_health()
        lost = CounterMetricFamily("hearth:telemetry_lost", "Telemetry rows that never reached the store, by reason",
                                   labels=["reason"])
        for reason in LOSS_REASONS:
            lost.add_metric([reason], float(health["lost_by_reason"].get(reason, 0)))
        written = CounterMetricFamily("hearth:telemetry_written", "Telemetry rows committed to the store")
        written.add_metric([], float(health["written_total"]))
        failing = GaugeMetricFamily("hearth:telemetry_failing", "1 while writes to the store are failing")
        failing.add_metric([], 1.0 if health["failing"] else 0.0)
        yield from (lost, written, failing)


    def _devices(self):
        """The budget per device (RAM is "CPU"): usable bytes, and the bytes resident models hold there by model."""
        budget = GaugeMetricFamily("hearth:device_budget_bytes", "Memory resident models may use on the device "
                                   "(CPU: RAM)", labels=["device"])
        used = GaugeMetricFamily("hearth:device_used_bytes", "Memory resident models hold on the device, as placed",
                                 labels=["device"])
        held = GaugeMetricFamily("hearth:model_device_bytes", "Memory a resident model holds on the device, as placed",
                                 labels=["model", "device"])
        for device, row in self.device_status().items():
            budget.add_metric([device], float(row["budget_bytes"]))
            used.add_metric([device], float(row["used_bytes"]))
            for model, n in row["models"].items():
                held.add_metric([model, device], float(n))
        yield from (budget, used, held)

    def _tiers(self):
        """The KV tiers per model, node and tier, from the sampler's latest scrape of each hearth runner (totals
        since the runner started, as its own /metrics says; a model unloaded leaves the families)."""
        hits = CounterMetricFamily("hearth:model_kv_tier_hits",
                                   "Admissions that got KV cells back from a tier instead of prefilling, latest scrape",
                                   labels=["model", "node", "tier"])
        restored = CounterMetricFamily("hearth:model_kv_tier_restored_tokens",
                                       "Prompt tokens restored from a tier instead of prefilled, latest scrape",
                                       labels=["model", "node", "tier"])
        held = GaugeMetricFamily("hearth:model_kv_tier_bytes", "Bytes of KV state a tier holds, latest scrape",
                                 labels=["model", "node", "tier"])
        seconds = CounterMetricFamily("hearth:model_kv_tier_restore_seconds",
                                      "Time spent restoring KV cells from the tiers (disk reads included), latest scrape",
                                      labels=["model", "node"])
        for source, t in sorted(self.sampler.tiers.items()):
            model, _, node = source.removeprefix("runner:").partition("@")
            for tier in ("ram", "disk"):
                hits.add_metric([model, node, tier], t[f"{tier}_hits"])
                restored.add_metric([model, node, tier], t[f"{tier}_restored_tokens"])
                held.add_metric([model, node, tier], t[f"{tier}_bytes"])
            seconds.add_metric([model, node], t["restore_seconds"])
        yield from (hits, restored, held, seconds)


class GatewayMetrics:
    """The registry behind `hearth serve`'s /metrics: request counters, and gauges read from the services' state."""

    def __init__(self, runner_status: Callable[[], list[dict]], gateway_status: Callable[[], dict[str, dict]],
                 sampler: Sampler, writer_health: Callable[[], dict],
                 device_status: Callable[[], dict[str, dict]] = dict):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_ResidencyCollector(runner_status, gateway_status, sampler, writer_health,
                                                   device_status))
        r = self.registry
        self.requests = Counter("hearth:gateway_requests", "Requests by class, model and outcome",
                                ["class", "model", "status"], registry=r)
        # By class and reason, not member: the persons a trusted token names are unbounded label values
        # (the Members page has the per-member counts from the refusals table).
        self.refusals = Counter("hearth:gateway_refusals", "Requests refused at admission, by class and reason "
                                "(app.gateway.refusals.REFUSAL_REASONS)", ["class", "reason"], registry=r)
        self.prompt_tokens = Counter("hearth:gateway_prompt_tokens", "Prompt tokens by class", ["class"], registry=r)
        self.completion_tokens = Counter("hearth:gateway_completion_tokens", "Generated tokens by class", ["class"],
                                         registry=r)
        self.features = Counter("hearth:gateway_feature_requests", "Requests using tools, structured output, "
                                "fill-in-the-middle or logprobs, by class and feature", ["class", "feature"], registry=r)
        # Speculative decoding as the request log records it (the runners' own counters are on their /metrics).
        self.draft_tokens = Counter("hearth:gateway_draft_tokens", "Draft tokens runners verified, by class", ["class"],
                                    registry=r)
        self.draft_accepted = Counter("hearth:gateway_draft_accepted_tokens", "Draft tokens runners kept, by class",
                                      ["class"], registry=r)
        # Images as the request log records them: how many each class sent, and the runners' encode time.
        self.images = Counter("hearth:gateway_images", "Images in requests' prompts, by class", ["class"], registry=r)
        self.image_encode = Histogram("hearth:gateway_image_encode_seconds",
                                      "Time a runner's projector spent encoding one request's images, by class",
                                      ["class"], buckets=IMAGE_ENCODE_BUCKETS_S, registry=r)
        # Transcriptions: the audio they carried and how long each took per second of it (the real-time factor).
        self.audio = Counter("hearth:gateway_audio_seconds", "Seconds of audio transcribed, by class", ["class"],
                             registry=r)
        self.audio_rtf = Histogram("hearth:gateway_transcription_real_time_factor",
                                   "A transcription's time from arrival to its last byte over its audio's length, "
                                   "by class", ["class"], buckets=RTF_BUCKETS, registry=r)
        # Speech out: characters spoken, audio written, time to first audio and the real-time factor, by class.
        self.speech_chars = Counter("hearth:gateway_speech_characters", "Characters spoken by the TTS voices, by class",
                                    ["class"], registry=r)
        self.speech_audio = Counter("hearth:gateway_speech_audio_seconds", "Seconds of speech written, by class",
                                    ["class"], registry=r)
        self.speech_first_audio = Histogram("hearth:gateway_speech_first_audio_seconds",
                                            "Arrival at the gateway to the first audio sent to the client, by class",
                                            ["class"], buckets=TTFT_BUCKETS_S, registry=r)
        self.speech_rtf = Histogram("hearth:gateway_speech_real_time_factor",
                                    "A speech request's time from arrival to its last byte over the audio's length, "
                                    "by class", ["class"], buckets=RTF_BUCKETS, registry=r)
        self.ttft = Histogram("hearth:gateway_ttft_seconds",
                              "Arrival at the gateway to the first generated token sent to the client (streamed or whole)", ["class"],
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.tpot = Histogram("hearth:gateway_tpot_seconds", "Time per output token", ["class"],
                              buckets=TPOT_BUCKETS_S, registry=r)
        self.queue = Histogram("hearth:gateway_queue_seconds", "Time waiting for admission", ["class"],
                               buckets=QUEUE_BUCKETS_S, registry=r)

    def observe(self, values: dict) -> None:
        """Count one recorded request (the same values the request log stores)."""
        klass = values.get("class_name") or "unknown"
        self.requests.labels(klass, values.get("model") or "unknown", values.get("status") or "unknown").inc()
        if values.get("refusal_reason"):
            self.refusals.labels(klass, values["refusal_reason"]).inc()
        for feature in (values.get("features") or "").split(","):
            if feature:
                self.features.labels(klass, feature).inc()
        if values.get("prompt_tokens"):
            self.prompt_tokens.labels(klass).inc(values["prompt_tokens"])
        if values.get("completion_tokens"):
            self.completion_tokens.labels(klass).inc(values["completion_tokens"])
        if values.get("draft_tokens"):
            self.draft_tokens.labels(klass).inc(values["draft_tokens"])
            self.draft_accepted.labels(klass).inc(values.get("draft_accepted") or 0)
        if values.get("images"):
            self.images.labels(klass).inc(values["images"])
            if values.get("image_encode_ms") is not None:
                self.image_encode.labels(klass).observe(values["image_encode_ms"] / 1000)
        if "speech" in (values.get("features") or "").split(","):
            self._speech(klass, values)
        elif values.get("audio_seconds"):
            self.audio.labels(klass).inc(values["audio_seconds"])
            if values.get("total_ms") is not None:
                self.audio_rtf.labels(klass).observe(values["total_ms"] / 1000 / values["audio_seconds"])
        for hist, key in ((self.ttft, "ttft_ms"), (self.tpot, "tpot_ms"), (self.queue, "queue_ms")):
            if values.get(key) is not None:
                hist.labels(klass).observe(values[key] / 1000)

    def _speech(self, klass: str, values: dict) -> None:
        self.speech_chars.labels(klass).inc(values.get("input_chars") or 0)
        if values.get("ttft_ms") is not None:
            self.speech_first_audio.labels(klass).observe(values["ttft_ms"] / 1000)
        if values.get("audio_seconds"):
            self.speech_audio.labels(klass).inc(values["audio_seconds"])
            if values.get("total_ms") is not None:
                self.speech_rtf.labels(klass).observe(values["total_ms"] / 1000 / values["audio_seconds"])

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return generate_latest(self.registry)
