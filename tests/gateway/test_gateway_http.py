"""`hearth serve` over real HTTP: auth, classes, admission, routing, relay, records, crashes."""

import json
import threading

import httpx
import pytest

from app.gateway.tokens import create_token, set_member_limits
from app.store.db import open_store, writing_sessions
from tests.helpers import metric, query, store_now, wait_until

DEFAULT = "gemma-3-270m-q4_k_m"


def auth(serve, member="alice", **extra):
    return {"Authorization": f"Bearer {serve.tokens[member]}", **extra}


def chat(serve, member="alice", headers=None, **body):
    payload = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6, "temperature": 0, **body}
    return serve.client.post("/v1/chat/completions", json=payload, headers={**auth(serve, member), **(headers or {})})


def rows(serve, sql, *args):
    """Rows from the serve's store, as committed so far."""
    return query(serve.data / "hearth.db", sql, *args)


def rows_once(serve, done, sql, *args):
    """The rows of sql once done(rows) holds: the store writer commits in batches, a moment after the answer."""
    def ready():
        got = rows(serve, sql, *args)
        return got if done(got) else None

    return wait_until(ready, 10, lambda: f"not recorded: {sql} gives {rows(serve, sql, *args)}")


def class_gauge(serve, name, klass):
    """hearth:class_waiting or hearth:class_in_flight of one class."""
    return metric(serve.client, f'hearth:{name}{{class="{klass}"}}')


def test_healthz_needs_no_token_and_no_model(serve):
    r = serve.client.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_missing_and_invalid_tokens_are_401(serve):
    r = serve.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_token"
    r = serve.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                          headers={"Authorization": "Bearer hth_nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_token"


def test_class_not_allowed_is_403_and_unknown_class_400(serve):
    r = chat(serve, "kid", headers={"X-Hearth-Class": "coding"})
    assert r.status_code == 403
    assert "may not use class 'coding'" in r.json()["error"]["message"]
    r = chat(serve, headers={"X-Hearth-Class": "poetry"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Hearth-Class"


def test_chat_through_the_gateway_names_class_model_and_node(serve):
    r = chat(serve, headers={"X-Hearth-Class": "voice"})
    assert r.status_code == 200, r.text
    assert r.headers["X-Hearth-Class"] == "voice"
    assert r.headers["X-Hearth-Model"] == DEFAULT
    assert r.headers["X-Hearth-Node"]
    body = r.json()
    assert body["usage"]["completion_tokens"] == 6
    assert body["hearth_class"] == "voice" and body["timings"]["priority"] == 0


def test_streaming_is_relayed_chunk_by_chunk_with_usage(serve):
    with serve.client.stream("POST", "/v1/completions", headers=auth(serve),
                             json={"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0,
                                   "stream": True}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 10
    assert chunks[-1]["usage"]["completion_tokens"] == 10


def test_models_lists_servable_models_not_broken_files(serve):
    r = serve.client.get("/v1/models", headers=auth(serve))
    ids = [m["id"] for m in r.json()["data"]]
    assert DEFAULT in ids and "gemma-b" in ids
    assert "notes" not in ids


def test_unknown_and_unusable_models_are_404(serve):
    r = chat(serve, model="no-such-model")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = chat(serve, model="notes")
    assert r.status_code == 404 and "cannot be served" in r.json()["error"]["message"]


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes please"}, "stream"),
])
def test_validation_errors_name_the_field(serve, body, param):
    r = serve.client.post("/v1/chat/completions", json=body, headers=auth(serve))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_malformed_json_is_400_and_serving_goes_on(serve):
    r = serve.client.post("/v1/chat/completions", content=b"{nope", headers={**auth(serve),
                                                                             "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert chat(serve).status_code == 200


def _occupy(serve, klass, tokens=300, **body):
    """Start a long request of a class in a thread; returns (thread, result holder)."""
    out = {}

    def run():
        with httpx.Client(base_url=serve.url, timeout=300) as c:
            out["r"] = c.post("/v1/completions", headers=auth(serve, **{"X-Hearth-Class": klass}),
                              json={"prompt": "Tell a story.", "max_tokens": tokens, "ignore_eos": True, **body})

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_full_class_queue_is_429_with_retry_after(serve):
    # coding: 1 at a time, 1 waiting.
    assert chat(serve).status_code == 200  # the runner is up: no cold start inside the queue wait
    t1, o1 = _occupy(serve, "coding", tokens=150)
    wait_until(lambda: class_gauge(serve, "class_in_flight", "coding") == 1, 30, "the first coding request never ran")
    t2, o2 = _occupy(serve, "coding", tokens=4)
    wait_until(lambda: class_gauge(serve, "class_waiting", "coding") == 1, 30, "the second coding request never queued")
    r = chat(serve, headers={"X-Hearth-Class": "coding"})
    assert r.status_code == 429, r.text
    assert r.headers["Retry-After"] == "1"
    assert r.json()["error"]["code"] == "queue_full"
    t1.join()
    t2.join()
    assert o1["r"].status_code == 200 and o2["r"].status_code == 200, (o1["r"].text, o2["r"].text)
    assert o2["r"].headers["X-Hearth-Queue-Position"] == "1"
    # Counted, not logged one row each: the flush_refusals job (every 10 s) adds the minute's count.
    wait_until(lambda: rows(serve, "select sum(count) from refusals where class_name='coding' and member_name='alice' "
                                   "and reason='class_queue_full'") == [(1,)], 30, "the refusal was never counted")
    assert rows(serve, "select count(*) from requests where class_name='coding' and status='rejected'") == [(0,)]


def test_n_choices_take_n_places_so_a_member_cannot_crowd_out_voice(serve):
    # chat runs 4 at once and alice holds half of it; the runner has 4 slots.
    assert chat(serve).status_code == 200  # the runner is up: no cold start below
    r = chat(serve, n=8)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "n_above_limit"
    assert "member 'alice' may hold 2 running places in class 'chat'" in r.json()["error"]["message"]
    # Two choices take both of alice's places: her next two wait at the gateway, not in the runner's slots.
    t1, o1 = _occupy(serve, "chat", tokens=48, n=2)
    wait_until(lambda: class_gauge(serve, "class_in_flight", "chat") == 2, 30, "the first n=2 request never ran")
    t2, o2 = _occupy(serve, "chat", tokens=4, n=2)
    wait_until(lambda: class_gauge(serve, "class_waiting", "chat") == 2, 30, "the second n=2 request never queued")
    # The runner has slots left for voice, which is answered while alice's second request still waits.
    v = chat(serve, "kid")
    assert v.status_code == 200, v.text
    assert "X-Hearth-Queue-Position" not in v.headers
    assert class_gauge(serve, "class_waiting", "chat") == 2
    t1.join()
    t2.join()
    assert o1["r"].status_code == 200 and len(o1["r"].json()["choices"]) == 2, o1["r"].text
    assert o2["r"].status_code == 200 and o2["r"].headers["X-Hearth-Queue-Position"] == "1", o2["r"].text


def test_waiting_past_the_class_timeout_is_503(serve):
    # documents: 1 at a time, 0.5 s queue timeout.
    t1, o1 = _occupy(serve, "documents", tokens=200)
    wait_until(lambda: class_gauge(serve, "class_in_flight", "documents") == 1, 30, "the documents request never ran")
    r = chat(serve, headers={"X-Hearth-Class": "documents"})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "queue_timeout"
    t1.join()
    assert o1["r"].status_code == 200


def test_every_request_is_recorded_with_its_timings(serve):
    since = store_now()
    assert chat(serve, headers={"X-Hearth-Class": "voice"}).status_code == 200
    got = rows_once(serve, bool, "select member_name, class_name, model, status, http_status, prompt_tokens, "
                                 "completion_tokens, total_ms, queue_ms, ttft_ms, tpot_ms from requests "
                                 "where class_name='voice' and arrival_at >= ?", since)
    assert len(got) == 1
    member, klass, model, status, http_status, p, c, total_ms, queue_ms, ttft_ms, tpot_ms = got[0]
    assert (member, klass, model, status, http_status, c) == ("alice", "voice", DEFAULT, "ok", 200, 6)
    assert p > 0 and total_ms > 0 and queue_ms >= 0
    # A whole (non-streamed) answer has a TTFT too: its first token reaches the client with the answer.
    assert 0 < ttft_ms < total_ms and tpot_ms > 0


def test_runner_killed_mid_stream_fails_clearly_and_restarts_on_the_next_request(serve):
    assert chat(serve).status_code == 200  # the default model's runner is up
    with serve.client.stream("POST", "/v1/completions", headers=auth(serve),
                             json={"prompt": "Tell a story.", "max_tokens": 400, "ignore_eos": True,
                                   "stream": True}) as r:
        it = r.iter_lines()
        seen = [next(it) for _ in range(6)]
        assert any(s.startswith("data: ") for s in seen)
        for p, command in serve.runner_commands():
            if DEFAULT in command:
                p.kill()
        rest = list(it)
    error_events = [json.loads(line[6:]) for line in rest if line.startswith("data: {") and '"error"' in line]
    assert error_events and error_events[0]["error"]["code"] == "runner_failed"
    r = chat(serve)
    assert r.status_code == 200, r.text
    # The crash, then the load of the restart.
    rows_once(serve, lambda got: ("crash",) in got and got[got.index(("crash",)):].count(("load",)) >= 1,
              "select event from residency_events where model_name=? order by id", DEFAULT)


def test_prometheus_metrics_count_requests_per_class(serve):
    chat(serve, headers={"X-Hearth-Class": "voice"})
    text = serve.client.get("/metrics").text
    assert f'hearth:gateway_requests_total{{class="voice",model="{DEFAULT}",status="ok"}}' in text
    assert 'hearth:gateway_queue_seconds_bucket{class="voice"' in text
    assert 'hearth:gateway_completion_tokens_total{class="voice"}' in text
    assert f'hearth:model_resident{{model="{DEFAULT}"}} 1.0' in text
    assert 'hearth:class_in_flight{class="voice"} 0.0' in text


def test_runner_errors_pass_through_with_their_status(serve):
    # The shared serve's runners hold 1024 cells: this prompt cannot fit even alone.
    r = serve.client.post("/v1/completions", headers=auth(serve), json={"prompt": "word " * 1500, "max_tokens": 4})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "1024 tokens" in err["message"]
    rows_once(serve, lambda got: ("error", 400) in got,
              "select status, http_status from requests where http_status = 400")
    assert chat(serve).status_code == 200


def test_a_members_tokens_count_toward_their_limit_once_the_answer_ends(serve):
    # A member of its own, made in the running serve's store: serve reads new tokens as they come.
    # Writing beside the running serve: its writer commits while this session reads (writing_sessions).
    engine, _ = open_store(serve.data)
    with writing_sessions(engine)() as s:
        token, _ = create_token(s, "counted", "chat")
        set_member_limits(s, "counted", {"max_tokens_per_min": 5})
    engine.dispose()
    headers = {"Authorization": f"Bearer {token}"}
    first = serve.client.post("/v1/chat/completions", headers=headers,
                              json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2})
    assert first.status_code == 200, first.text  # under the limit when it started; its tokens cross it
    r = serve.client.post("/v1/chat/completions", headers=headers,
                          json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2})
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "member_rate_limited" and "max_tokens_per_min" in r.json()["error"]["message"]
    assert 1 <= int(r.headers["Retry-After"]) <= 61


def test_streams_cut_before_their_usage_are_stored_and_charged_with_what_they_used(serve):
    engine, _ = open_store(serve.data)
    with writing_sessions(engine)() as s:
        token, _ = create_token(s, "cutter", "chat")
        set_member_limits(s, "cutter", {"max_tokens_per_min": 45})
    engine.dispose()
    headers = {"Authorization": f"Bearer {token}"}
    body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 300, "ignore_eos": True,
            "temperature": 0, "stream": True}
    for _ in range(3):
        with serve.client.stream("POST", "/v1/chat/completions", headers=headers, json=body) as r:
            assert r.status_code == 200
            pieces = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    # The running count the gateway asked the runner for is not the client's to see.
                    assert "timings" not in chunk and "usage" not in chunk, chunk
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        pieces.append(chunk)
                if len(pieces) >= 5:
                    break  # the client goes away before the usage chunk
    got = rows_once(serve, lambda got: len(got) == 3,
                    "select status, prompt_tokens, completion_tokens from requests where member_name='cutter'")
    for status, prompt_tokens, completion_tokens in got:
        assert status == "cancelled" and prompt_tokens > 5 and completion_tokens >= 5, got
    # Three cut streams used more than the member's 45 tokens a minute: the next request is refused.
    r = serve.client.post("/v1/chat/completions", headers=headers,
                          json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2})
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "member_rate_limited" and "max_tokens_per_min" in r.json()["error"]["message"]
