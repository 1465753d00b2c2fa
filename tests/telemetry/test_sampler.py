"""Sampling: host, GPUs (present or not) and runners' counters turned into rates."""

from collections import namedtuple
from types import SimpleNamespace

import pytest
from sqlalchemy import select

from app import hardware
from app.residency.manager import ModelState
from app.store.models import Sample, Series
from app.store.writer import StoreWriter
from app.telemetry import sampler as sampler_mod
from app.telemetry.sampler import (
    METRICS,
    RateTracker,
    Sampler,
    ScrapeFailures,
    sample_gpus,
    sample_host,
    sample_runners,
    store_readings,
)


def metrics_text(predicted, prompt, processing=1, deferred=0, kv_used=512, kv_total=2048, preemptions=0):
    """Prometheus text as a Hearth runner writes it."""
    return f"""# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total {prompt}
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total {predicted}
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing {processing}
llamacpp:requests_deferred {deferred}
hearth:kv_cells_used {kv_used}
hearth:kv_cells_total {kv_total}
hearth:preemptions_total {preemptions}
hearth:ttft_seconds_bucket{{le="0.05"}} 3
"""


SLOTS = '[{"id": 0, "is_processing": true}, {"id": 1, "is_processing": false}, {"id": 2, "is_processing": true}]'


class FakeHttp:
    """Serves queued /metrics bodies (one per scrape) and a fixed /slots; records the URLs asked."""

    def __init__(self, metrics_bodies, slots=SLOTS):
        self.metrics_bodies = list(metrics_bodies)
        self.slots = slots
        self.urls = []

    def __call__(self, url, timeout_s):
        self.urls.append((url, timeout_s))
        if url.endswith("/metrics"):
            return self.metrics_bodies.pop(0)
        if url.endswith("/slots"):
            return self.slots
        raise AssertionError(url)


def status(name="gemma", state=ModelState.READY, nodes=None):
    """One model as ResidencyManager.status() describes it."""
    if nodes is None:
        nodes = [{"label": "local", "url": "http://127.0.0.1:9001", "local": True, "healthy": True}]
    return {"name": name, "state": state, "nodes": nodes, "pid": 1, "rss_bytes": 0}


def as_dict(readings):
    return {(s, m): v for s, m, v in readings}


def test_counters_become_rates_against_the_previous_scrape():
    http = FakeHttp([metrics_text(100, 1000, preemptions=1), metrics_text(150, 1400, preemptions=3, kv_used=1024)])
    rates = RateTracker()
    first = as_dict(sample_runners([status()], http, rates, now=1000.0))
    src = "runner:gemma@local"
    # No rate from a single scrape; gauges are there at once.
    assert (src, "gen_tok_s") not in first
    assert first[(src, "running")] == 1 and first[(src, "waiting")] == 0
    assert first[(src, "kv_used_pct")] == 25.0
    assert first[(src, "slots_busy")] == 2
    second = as_dict(sample_runners([status()], http, rates, now=1002.0))
    assert second[(src, "gen_tok_s")] == pytest.approx(25.0)
    assert second[(src, "prompt_tok_s")] == pytest.approx(200.0)
    assert second[(src, "preemptions_s")] == pytest.approx(1.0)
    assert second[(src, "kv_used_pct")] == 50.0
    assert all(timeout == sampler_mod.SCRAPE_TIMEOUT_S for _, timeout in http.urls)


def test_the_slo_budget_and_its_target_are_read_as_gauges():
    text = metrics_text(1, 1) + "hearth:prefill_budget 136\nhearth:budget_tpot_target_seconds 0.1\n"
    got = as_dict(sample_runners([status()], FakeHttp([text]), RateTracker(), now=0.0))
    assert got[("runner:gemma@local", "prefill_budget")] == 136
    assert got[("runner:gemma@local", "budget_tpot_ms")] == pytest.approx(100.0)


def test_a_counter_reset_gives_no_rate_instead_of_a_negative_one():
    http = FakeHttp([metrics_text(500, 5000), metrics_text(10, 100), metrics_text(30, 100)])
    rates = RateTracker()
    sample_runners([status()], http, rates, now=0.0)
    after_restart = as_dict(sample_runners([status()], http, rates, now=1.0))
    assert ("runner:gemma@local", "gen_tok_s") not in after_restart
    assert as_dict(sample_runners([status()], http, rates, now=2.0))[("runner:gemma@local", "gen_tok_s")] == 20.0


def test_only_healthy_nodes_of_ready_models_are_scraped_and_failures_are_skipped():
    def http(url, timeout_s):
        if "9002" in url:
            raise OSError("connection refused")
        return metrics_text(1, 1) if url.endswith("/metrics") else "[]"

    statuses = [
        status("loading-model", state=ModelState.LOADING),
        status("gemma", nodes=[
            {"label": None, "url": "http://127.0.0.1:9001/", "healthy": True},
            {"label": "down", "url": "http://127.0.0.1:9002", "healthy": True},
            {"label": "sick", "url": "http://127.0.0.1:9003", "healthy": False},
        ]),
    ]
    readings = sample_runners(statuses, http, RateTracker(), now=0.0)
    # An unlabelled node is named by its URL.
    assert {s for s, _, _ in readings} == {"runner:gemma@http://127.0.0.1:9001"}


def test_failed_scrapes_are_counted_per_node_and_warned_once_per_streak(caplog):
    bodies = {"9001": ["<html>502 Bad Gateway</html>", OSError("connection refused"), OSError("refused"),
                       metrics_text(1, 1), OSError("refused again")]}

    def http(url, timeout_s):
        if url.endswith("/slots"):
            return "[]"
        if "9002" in url:
            return metrics_text(1, 1)
        body = bodies["9001"].pop(0)
        if isinstance(body, Exception):
            raise body
        return body

    statuses = [status("gemma", nodes=[{"label": "local", "url": "http://127.0.0.1:9001", "healthy": True},
                                       {"label": "desk", "url": "http://127.0.0.1:9002", "healthy": True}])]
    failures, rates = ScrapeFailures(), RateTracker()
    with caplog.at_level("INFO", logger="app.telemetry.sampler"):
        for now in range(3):
            readings = sample_runners(statuses, http, rates, now=float(now), failures=failures)
            assert {s for s, _, _ in readings} == {"runner:gemma@desk"}
        assert failures.totals() == {("gemma", "local"): 3, ("gemma", "desk"): 0}
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        # The unreadable page starts the streak; the refused connections that follow are only counted.
        assert len(warnings) == 1 and "http://127.0.0.1:9001/metrics" in warnings[0]
        assert "not Prometheus text" in warnings[0] and "refused" not in warnings[0]
        caplog.clear()
        sample_runners(statuses, http, rates, now=3.0, failures=failures)
        assert [r.levelname for r in caplog.records] == ["INFO"] and "after 3 failed" in caplog.records[0].getMessage()
        caplog.clear()
        sample_runners(statuses, http, rates, now=4.0, failures=failures)
    assert failures.totals()[("gemma", "local")] == 4
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "refused again" in caplog.records[0].getMessage()


def test_plain_llama_server_without_hearth_metrics_or_slots():
    def http(url, timeout_s):
        if url.endswith("/slots"):
            raise OSError("501 Not Implemented")
        return "llamacpp:requests_processing 2\nllamacpp:requests_deferred 1\n"

    readings = as_dict(sample_runners([status()], http, RateTracker(), now=0.0))
    assert readings == {("runner:gemma@local", "running"): 2.0, ("runner:gemma@local", "waiting"): 1.0}


def test_host_reports_cpu_and_ram_used_as_total_minus_available():
    vm = namedtuple("vm", "total available used")(8000, 3000, 1000)
    fake = SimpleNamespace(virtual_memory=lambda: vm, cpu_percent=lambda interval: 12.5)
    assert as_dict(sample_host(fake)) == {
        ("host", "cpu_pct"): 12.5, ("host", "ram_used_bytes"): 5000.0, ("host", "ram_total_bytes"): 8000.0,
    }


def test_real_host_sample_is_sane():
    readings = as_dict(sample_host())
    assert 0 < readings[("host", "ram_used_bytes")] <= readings[("host", "ram_total_bytes")]


class FakeNvml:
    """Two GPUs; the second refuses to report power, as consumer cards do."""

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=40 + h)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=1 << 30, total=24 << 30)

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 61

    def nvmlDeviceGetPowerUsage(self, h):
        if h == 1:
            raise RuntimeError("Not Supported")  # pynvml's NVMLError_NotSupported says so
        return 215500


@pytest.fixture
def fresh_reports(monkeypatch):
    """NVML failures are logged once per process: each test starts with none reported."""
    monkeypatch.setattr(hardware, "_reported", set())


def test_gpus_are_read_one_metric_at_a_time(caplog, fresh_reports):
    with caplog.at_level("INFO", logger="app.hardware"):
        readings = as_dict(sample_gpus(FakeNvml()))
    assert readings[("gpu:0", "gpu_util_pct")] == 40 and readings[("gpu:1", "gpu_util_pct")] == 41
    assert readings[("gpu:0", "gpu_power_w")] == 215.5
    assert ("gpu:1", "gpu_power_w") not in readings
    assert readings[("gpu:1", "vram_total_bytes")] == 24 << 30
    assert readings[("gpu:1", "gpu_temp_c")] == 61
    # A card without a power sensor is normal: said once at info, no warning.
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "telemetry: gpu:1 gpu_power_w: Not Supported")]


class LostGpu(FakeNvml):
    """A GPU that fell off the bus: every reading fails with an error that is not "no GPU"."""

    def nvmlDeviceGetMemoryInfo(self, h):
        raise RuntimeError("GPU is lost")


def test_an_nvml_error_other_than_no_gpu_is_a_warning_once(caplog, fresh_reports):
    with caplog.at_level("INFO", logger="app.hardware"):
        first = as_dict(sample_gpus(LostGpu()))
        sample_gpus(LostGpu())
    assert ("gpu:0", "vram_used_bytes") not in first and first[("gpu:0", "gpu_util_pct")] == 40
    warnings = sorted(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    # Once per GPU and reading, not once a second.
    assert warnings == [f"telemetry: gpu:{i} {m}: GPU is lost" for i in (0, 1) for m in ("vram_total_bytes", "vram_used_bytes")]


def test_nvml_that_cannot_list_devices_warns(caplog, fresh_reports):
    class NoPermission:
        def nvmlDeviceGetCount(self):
            raise RuntimeError("Insufficient Permissions")

    with caplog.at_level("INFO", logger="app.hardware"):
        assert sample_gpus(NoPermission()) == []
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "NVML lists no devices: Insufficient Permissions")]


def test_absent_gpu_is_normal(monkeypatch, caplog, fresh_reports):
    class NoDevice:
        def nvmlDeviceGetCount(self):
            return 0

    with caplog.at_level("WARNING"):
        assert sample_gpus(NoDevice()) == []
        # No library or driver at all: open_nvml gives None and sampling gives [].
        monkeypatch.setattr(hardware, "open_nvml", lambda: None)
        assert sample_gpus() == []
    assert caplog.records == []


def test_every_stored_metric_has_metadata():
    names = {m for m in sampler_mod.RUNNER_COUNTERS.values()} | set(sampler_mod.RUNNER_GAUGES.values())
    names |= {"kv_used_pct", "slots_busy", "cpu_pct", "ram_used_bytes", "ram_total_bytes"}
    names |= {m for _, m, _ in sample_gpus(FakeNvml())}
    assert names <= METRICS.keys()
    assert all(m.unit and m.description for m in METRICS.values())


def test_store_readings_creates_series_once_and_replaces_a_repeated_second(sessions):
    with sessions.begin() as s:
        store_readings(s, 100, [("host", "cpu_pct", 10.0), ("gpu:0", "gpu_temp_c", 50.0)])
    with sessions.begin() as s:
        store_readings(s, 100, [("host", "cpu_pct", 20.0), ("host", "ram_used_bytes", float("nan"))])
        store_readings(s, 101, [("host", "cpu_pct", 30.0)])
    with sessions() as s:
        assert s.scalar(select(Series).where(Series.metric == "ram_used_bytes")) is None
        rows = s.execute(select(Series.source, Series.metric, Sample.at, Sample.value).join(Sample)
                         .order_by(Series.source, Sample.at)).all()
    assert rows == [("gpu:0", "gpu_temp_c", 100, 50.0), ("host", "cpu_pct", 100, 20.0), ("host", "cpu_pct", 101, 30.0)]


class FakeResidency:
    def __init__(self, statuses):
        self.statuses = statuses

    def status(self):
        return self.statuses


class FakeAdmission:
    def snapshot(self):
        return {"chat": {"waiting": 2, "in_flight": 4}, "voice": {"waiting": 1, "in_flight": 0}}


@pytest.fixture
def writer(engine):
    w = StoreWriter(engine)
    w.start()
    yield w
    w.stop(timeout_s=5)


def test_sample_all_writes_one_batch_through_the_writer(engine, sessions, writer):
    t = [1000.0]
    http = FakeHttp([metrics_text(0, 0), metrics_text(30, 90)])
    nogpu = SimpleNamespace(nvmlDeviceGetCount=lambda: 0)
    sampler = Sampler(writer, FakeResidency([status()]).status, FakeAdmission().snapshot, clock=lambda: t[0],
                      http_get=http, nvml=nogpu)
    sampler.sample_all()
    t[0] = 1001.0
    n = sampler.sample_all()
    assert writer.flush(timeout_s=5)
    assert sampler.latest_at == 1001
    assert sampler.latest["runner:gemma@local"]["gen_tok_s"] == 30.0
    assert sampler.latest["host"].keys() == {"cpu_pct", "ram_used_bytes", "ram_total_bytes"}
    with sessions() as s:
        at_1001 = s.execute(select(Series.source, Series.metric, Sample.value).join(Sample).where(Sample.at == 1001)).all()
    assert len(at_1001) == n
    assert ("runner:gemma@local", "prompt_tok_s", 90.0) in at_1001


def test_the_sampler_reads_gateway_and_runners_through_what_it_was_given(writer):
    runners = []
    nogpu = SimpleNamespace(nvmlDeviceGetCount=lambda: 0)
    sampler = Sampler(writer, lambda: runners, FakeAdmission().snapshot, clock=lambda: 5.0,
                      http_get=FakeHttp([]), nvml=nogpu)
    assert sampler.sample_all() == 5  # host and gateway: no GPU, no runner
    assert sampler.latest["gateway"] == {"queue_waiting": 3.0, "in_flight": 4.0}
    assert sampler.latest_at == 5
