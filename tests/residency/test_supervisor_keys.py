"""A runner serve starts wants the key serve gave it (passed in its environment, never on its command
line) on every route but /health, answers no browser, and everything in serve that calls it sends
the key: the relay, the probes and the telemetry scrape. On the real Gemma GGUF."""

from __future__ import annotations

import httpx
import psutil
import pytest

from app.gateway import relay
from app.residency.remote import RemoteNode
from app.residency.runner_spec import RunnerSpec
from app.residency.supervisor import LLAMA_KEY_ENV, RUNNER_KEY_ENV, RunnerProcess, key_environment, new_runner_key, runner_headers
from app.telemetry.sampler import RateTracker, ScrapeFailures, _httpx_get, sample_runners

EVIL_ORIGIN = "http://evil.example"
CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2}


def small_spec(path) -> RunnerSpec:
    """A runner small enough to start in seconds on two cores."""
    return RunnerSpec(model_name="gemma", model_path=str(path), n_ctx=512, parallel=2, n_batch=512, threads=2)


@pytest.fixture(scope="module")
def keyed(gemma_path):
    """A runner started as serve's residency manager starts one: with a key of its own."""
    runner = RunnerProcess(small_spec(gemma_path), api_key=new_runner_key())
    runner.start(timeout_s=120)
    yield runner
    runner.stop()
    relay.close_idle()


def test_the_key_travels_in_the_environment_never_on_a_command_line(keyed):
    processes = [psutil.Process(pid) for pid in keyed.pids()]
    assert len(processes) == 2  # gunicorn's arbiter and its worker
    for p in processes:
        command = " ".join(p.cmdline())
        assert keyed.api_key not in command, command
        # Nothing started by serve is meant for a browser.
        assert "--cors-origins none" in command
        assert p.environ().get(RUNNER_KEY_ENV) == keyed.api_key


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/metrics"), ("GET", "/slots"), ("GET", "/props"), ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/v1/messages"),
])
def test_every_route_but_health_wants_the_key(keyed, method, path):
    body = {**CHAT, "content": "hi"} if method == "POST" else None
    missing = httpx.request(method, keyed.url + path, json=body, timeout=30)
    assert missing.status_code == 401, missing.text
    error = missing.json()["error"]
    assert error["code"] == "invalid_api_key" and "Authorization: Bearer" in error["message"]
    wrong = httpx.request(method, keyed.url + path, json=body, timeout=30,
                          headers={"Authorization": f"Bearer {new_runner_key()}"})
    assert wrong.status_code == 401 and wrong.json()["error"]["message"] == "Invalid API Key"
    assert httpx.get(keyed.url + "/health", timeout=10).status_code == 200


def test_the_runner_answers_no_browser(keyed):
    preflight = httpx.options(keyed.url + "/v1/chat/completions", timeout=10,
                              headers={"Origin": EVIL_ORIGIN, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers
    assert preflight.status_code == 401  # no preflight answer: it went to the key check like any request
    with_key = httpx.get(keyed.url + "/props", headers={"Origin": EVIL_ORIGIN, **keyed.headers}, timeout=10)
    assert with_key.status_code == 200
    assert not any(h.startswith("access-control-") for h in with_key.headers)


def test_serves_own_callers_send_the_key(keyed):
    assert runner_headers(keyed.url) == keyed.headers
    # The relay, as the gateway's pipeline calls it: with nothing but the URL.
    answer, outcome = relay.post(keyed.url + "/v1/chat/completions", CHAT)
    assert answer.status_code == 200 and outcome.usage["completion_tokens"] >= 1, answer.text
    stream, outcome = relay.open_stream(keyed.url + "/v1/chat/completions", {**CHAT, "stream": True})
    assert stream.status_code == 200
    assert b"[DONE]" in b"".join(relay.stream_chunks(stream, outcome)) and outcome.token_seen
    # The probes the residency manager runs on its local node.
    probe = RemoteNode(keyed.url, "local")
    assert probe.healthy() and probe.load() is not None
    # The telemetry sampler's scrape of /metrics and /slots.
    statuses = [{"name": "gemma", "state": "ready",
                 "nodes": [{"label": "local", "url": keyed.url, "local": True, "healthy": True}]}]
    failures, http_get = ScrapeFailures(), _httpx_get()
    try:
        readings = sample_runners(statuses, http_get, RateTracker(), 0.0, failures)
    finally:
        http_get.close()
    metrics = {m for _, m, _ in readings}
    assert {"kv_used_pct", "slots_busy"} <= metrics, readings
    assert failures.totals() == {("gemma", "local"): 0}


def test_a_runner_without_a_key_stays_open_and_a_stopped_ones_key_is_forgotten(gemma_path):
    # The bench's own runners (no key): nothing is asked, nothing is sent.
    runner = RunnerProcess(small_spec(gemma_path)).start(timeout_s=120)
    try:
        assert runner_headers(runner.url) == {} and runner.headers == {}
        assert httpx.get(runner.url + "/props", timeout=10).status_code == 200
        assert RUNNER_KEY_ENV not in psutil.Process(runner.pid).environ()
    finally:
        runner.stop()
    keyed = RunnerProcess(small_spec(gemma_path), api_key=new_runner_key()).start(timeout_s=120)
    url = keyed.url
    assert runner_headers(url) == keyed.headers
    keyed.stop()
    # Another process may take the port next: it must never be handed this key.
    assert runner_headers(url) == {}


def test_each_runner_kind_reads_its_key_from_its_own_variable():
    assert key_environment("hearth", "k") == {RUNNER_KEY_ENV: "k"}
    # llama.cpp's common/arg.cpp: --api-key is read from LLAMA_API_KEY when the flag is absent.
    assert key_environment("llama-server", "k") == {LLAMA_KEY_ENV: "k"}
    assert key_environment("hearth", None) == {}
    assert new_runner_key() != new_runner_key() and len(new_runner_key()) >= 40
