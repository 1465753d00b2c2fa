"""/metrics on hearth serve carries what the dashboard shows: per-class counters and latency
histograms, residency gauges and KV usage per model."""

from prometheus_client.parser import text_string_to_metric_families

from app.gateway.context import services
from app.residency.manager import ModelState
from app.telemetry.sampler import RateTracker, sample_runners


def families(client) -> dict:
    response = client.get("/metrics")
    assert response.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(response.get_data(as_text=True))}


def test_metrics_cover_classes_residency_and_kv(app, client):
    hearth = services(app)
    hearth.metrics.observe({"class_name": "voice", "model": "gemma", "status": "ok", "prompt_tokens": 5,
                            "completion_tokens": 7, "ttft_ms": 120.0, "tpot_ms": 20.0, "queue_ms": 3.0})
    hearth.sampler.latest = {"runner:gemma@local": {"kv_used_pct": 37.5}, "host": {"cpu_pct": 1.0}}
    found = families(client)
    requests = found["hearth:gateway_requests"].samples
    assert any(s.labels == {"class": "voice", "model": "gemma", "status": "ok"} and s.value == 1 for s in requests)
    for name in ("hearth:gateway_ttft_seconds", "hearth:gateway_tpot_seconds", "hearth:gateway_queue_seconds"):
        assert found[name].type == "histogram", name
        assert any(s.name.endswith("_bucket") and s.labels.get("class") == "voice" for s in found[name].samples)
    assert "hearth:model_resident" in found and "hearth:model_estimate_bytes" in found
    kv = found["hearth:model_kv_used_percent"].samples
    assert [(s.labels, s.value) for s in kv] == [({"model": "gemma", "node": "local"}, 37.5)]


def test_failed_runner_scrapes_are_exported_per_model_and_node(app, client):
    hearth = services(app)

    def refused(url, timeout_s):
        raise OSError("connection refused")

    ready = [{"name": "gemma", "state": ModelState.READY,
              "nodes": [{"label": "local", "url": "http://127.0.0.1:9", "healthy": True}]}]
    for now in (1.0, 2.0):
        sample_runners(ready, refused, RateTracker(), now, hearth.sampler.scrape_failures)
    found = families(client)["hearth:runner_scrape_failures"]
    assert found.type == "counter"
    assert [(s.name, s.labels, s.value) for s in found.samples] == [
        ("hearth:runner_scrape_failures_total", {"model": "gemma", "node": "local"}, 2.0)]


def test_the_kv_tiers_are_exported_per_model_node_and_tier_as_the_runner_said_them(app, client):
    from app.engine.engine import Engine
    from app.engine.request import Finished, SamplingParams
    from app.exposition import parse_exposition
    from app.runner.metrics import RunnerMetrics
    from tests.engine.fake_model import FakeModel

    hearth = services(app)
    # A real engine on the fake model, 64 cells: the second prompt evicts the first to the RAM tier, the third
    # brings it back.
    model = FakeModel(n_ctx=64, n_batch=64, n_seq_max=2, transfer_seq=4)
    engine = Engine(model, clock=model.clock, cache_ram_bytes=None).start()
    try:
        for tokens in ([1000 + i for i in range(40)], [2000 + i for i in range(40)], [1000 + i for i in range(43)]):
            r = engine.submit(tokens, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            assert next(ev for ev in engine.events(r) if isinstance(ev, Finished)).error is None
        runner_text = RunnerMetrics(engine).render().decode()
    finally:
        engine.stop()
    ready = [{"name": "gemma", "state": ModelState.READY,
              "nodes": [{"label": "local", "url": "http://127.0.0.1:9", "healthy": True}]}]
    hearth.sampler.tiers = {}
    sample_runners(ready, lambda url, t: runner_text if url.endswith("/metrics") else "[]", RateTracker(), 1.0,
                   tiers=hearth.sampler.tiers)
    runner, served = parse_exposition(runner_text), parse_exposition(client.get("/metrics").get_data(as_text=True))
    assert runner.value("hearth:kv_tier_hits_total", {"tier": "ram"}) == 1
    for name in ("hearth:kv_tier_hits_total", "hearth:kv_tier_restored_tokens_total", "hearth:kv_tier_bytes"):
        for tier in ("ram", "disk"):
            want = runner.value(name, {"tier": tier})
            got = served.value(name.replace("hearth:", "hearth:model_"), {"model": "gemma", "node": "local", "tier": tier})
            assert got == want, (name, tier)
    assert served.value("hearth:model_kv_tier_bytes", {"tier": "ram"}) > 0
    assert served.value("hearth:model_kv_tier_restore_seconds_total", {"model": "gemma", "node": "local"}) == \
        runner.value("hearth:kv_tier_restore_seconds_total") > 0


def test_the_cpu_a_stream_costs_is_exported_per_process(app, client):
    hearth = services(app)
    assert hearth.sampler.stream_cost is not None
    assert "hearth:stream_cpu_seconds_per_1k_tokens" in families(client)  # no samples before any token
    hearth.sampler.stream_cost.sample([])
    hearth.metrics.observe({"class_name": "chat", "model": "gemma", "status": "ok", "completion_tokens": 1000})
    hearth.sampler.stream_cost.sample([])  # serve's own CPU, no runner: the runner's figure is 0
    samples = {s.labels["process"]: s.value
               for s in families(client)["hearth:stream_cpu_seconds_per_1k_tokens"].samples}
    assert set(samples) == {"serve", "runner"} and samples["serve"] >= 0.0 and samples["runner"] == 0.0
