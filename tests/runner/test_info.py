"""The runner's descriptive routes on the fake model: /health, /slots, /props, /metrics, /models."""

from __future__ import annotations

from tests.runner.streams import loads


def test_health_slots_props_and_models_describe_the_loaded_runner(make_runner):
    c = make_runner(alias="fake-a,fake-b")
    health = loads(c.get("/health"))
    timings = health.pop("load_timings")
    assert health == {"status": "ok", "slots_idle": 4, "slots_processing": 0, "requests_waiting": 0}
    # The fake model reports no phases of its own: its whole load is the engine's part.
    assert timings["read_ms"] is None and timings["upload_ms"] is None and timings["engine_ms"] == timings["load_ms"]
    slots = loads(c.get("/slots"))
    assert [s["id"] for s in slots] == [0, 1, 2, 3] and {s["id_task"] for s in slots} == {-1}
    props = loads(c.get("/props"))
    assert props["model_alias"] == "fake-a" and props["total_slots"] == 4 and props["tool_format"] == "generic"
    assert props["default_generation_settings"]["n_ctx"] == 1024 and props["bos_token"] == "<s>"
    assert [m["aliases"] for m in loads(c.get("/v1/models"))["data"]] == [["fake-a", "fake-b"]]


def test_metrics_count_what_was_generated(make_runner):
    c = make_runner(replies={"Say hi": "Hello there"})
    loads(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Say hi"}]}))
    text = c.get("/metrics").get_data(as_text=True)
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    # Sampled tokens: the answer's 11 and the end-of-generation token that ended it.
    assert float(lines["llamacpp:tokens_predicted_total"]) == 12
    assert float(lines['hearth:requests_finished_total{reason="stop"}']) == 1
    assert "hearth:prefix_cache_entries" in lines and "hearth:last_iteration_outside_decode_ratio" in lines
    assert float(lines["llamacpp:n_tokens_max"]) > 11


def test_the_first_request_after_the_load_adds_its_prefill_and_restore_to_the_load_timings(make_runner):
    c = make_runner(replies={"Say hi": "Hello there", "Again": "Hi"})
    assert "first_prefill_ms" not in loads(c.get("/props"))["load_timings"]
    loads(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Say hi"}]}))
    first = loads(c.get("/props"))["load_timings"]
    assert first["first_prefill_ms"] >= 0 and first["kv_source"] == "none" and first["restore_ms"] == 0
    assert first["first_prompt_tokens"] > 0
    # Only the first one: a later request leaves the load's figures as they were.
    loads(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Again"}]}))
    assert loads(c.get("/health"))["load_timings"] == first
