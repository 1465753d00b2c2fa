"""`hearth runner` over real HTTP on loopback: OpenAI shapes, streaming, errors, cancellation, preemption."""

import json
import socket
import threading
import time

import httpx
import pytest

from app.protocols.openai import MAX_BODY_BYTES, MAX_GENERATION_BODY_BYTES
from tests.helpers import wait_until


def sse_events(resp: httpx.Response) -> list:
    """Parsed `data:` payloads of a streamed response ([DONE] kept as the string)."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_serving(runner) -> None:
    """After an error the runner must answer a normal request normally."""
    r = runner.client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_health_props_and_models(runner):
    h = runner.client.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    props = runner.client.get("/props").json()
    assert props["total_slots"] == 4 and props["mode"] == "continuous"
    assert props["model"]["n_ctx"] == 2048
    assert runner.client.get("/v1/models").json()["data"][0]["id"].endswith(".gguf")


def test_completion_shape_and_usage(runner):
    r = runner.client.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 6,
                                                    "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"]
    assert body["usage"]["completion_tokens"] == 6
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 6


def test_chat_completion_uses_gemma_template(runner):
    r = runner.client.post("/v1/chat/completions", json={
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}],
        "max_tokens": 5, "temperature": 0,
    })
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    gemma = "<start_of_turn>user\nBe brief.\n\nSay hi.<end_of_turn>\n<start_of_turn>model\n"
    expected = runner.client.post("/tokenize", json={"content": gemma, "add_special": True}).json()["tokens"]
    assert expected[0] == 2  # <bos>, once
    assert body["usage"]["prompt_tokens"] == len(expected)


def test_tokenize_round_trip(runner):
    tokens = runner.client.post("/tokenize", json={"content": "Hello, wörld 🙂"}).json()["tokens"]
    assert runner.client.post("/detokenize", json={"tokens": tokens}).json()["content"] == "Hello, wörld 🙂"
    assert runner.client.post("/detokenize", json={"tokens": [10**9]}).status_code == 400


def test_streaming_matches_non_streaming(runner):
    req = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    whole = runner.client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    with runner.client.stream("POST", "/v1/completions", json={**req, "stream": True,
                                                               "stream_options": {"include_usage": True}}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f["choices"][0]["finish_reason"] for f in finals] == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


def test_chat_streaming_deltas(runner):
    with runner.client.stream("POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 8, "temperature": 0,
        "stream": True,
    }) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_stop_string_over_http(runner):
    req = {"prompt": "Count: 1, 2, 3, 4, 5,", "max_tokens": 30, "temperature": 0}
    free = runner.client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    assert "8" in free
    body = runner.client.post("/v1/completions", json={**req, "stop": ["8"]}).json()
    assert body["choices"][0]["text"] == free[: free.index("8")]
    assert body["choices"][0]["finish_reason"] == "stop"


BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 4', 400, None, "not valid JSON"),
    ("/v1/completions", b'[1, 2]', 400, None, "JSON object"),
    ("/v1/completions", b'{"max_tokens": 4}', 400, "prompt", "required"),
    ("/v1/completions", b'{"prompt": ""}', 400, "prompt", "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens", "greater than or equal to 1"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "lots"}', 400, "max_tokens", "integer"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 3}', 400, "temperature", "less than or equal to 2"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": 0}', 400, "top_p", "greater than 0"),
    ("/v1/completions", b'{"prompt": "hi", "n": 9}', 400, "n", "less than or equal to 8"),
    ("/v1/completions", b'{"prompt": [1, 99999999]}', 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", b'{"prompt": "hi", "stop": 5}', 400, "stop", "stop"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, "UTF-8"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages", "at least 1"),
    ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "hi"}]}', 400, "messages.0.role",
     "unknown role"),
    ("/v1/chat/completions", b'{"messages": [{"content": "hi"}]}', 400, "messages.0.role", "required"),
    ("/v1/chat/completions", b'{"messages": [{"role": "assistant", "content": "hi"}, {"role": "assistant", '
     b'"content": "again"}]}', 400, "messages", "two assistant messages"),
    ("/v1/completions", b'{"prompt": "hi", "priority": "high"}', 400, "priority", "integer"),
]


@pytest.mark.parametrize("path,body,status,param,fragment", BAD_REQUESTS)
def test_bad_input_gets_a_clear_openai_error_and_the_runner_keeps_serving(runner, path, body, status, param,
                                                                          fragment):
    r = runner.client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert fragment.lower() in err["message"].lower(), err["message"]
    assert_serving(runner)


def test_prompt_longer_than_context_names_the_counts(runner):
    prompt = "word " * 3000
    n = len(runner.client.post("/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"])
    r = runner.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert f"{n} tokens" in err["message"] and "2048 tokens" in err["message"]
    assert_serving(runner)


def test_body_over_the_size_limit_is_413(runner):
    # A generation makes room for an image: 5 MiB of prompt is read (and is too long for the context: a 400) ...
    r = runner.client.post("/v1/completions", content=b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}',
                           headers={"content-type": "application/json"})
    assert r.status_code == 400
    # ... more than its limit is a 413 naming it, and other routes keep the 4 MiB limit.
    r = runner.client.post("/v1/completions", content=b'{"prompt": "' + b"a" * MAX_GENERATION_BODY_BYTES + b'"}',
                           headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert f"limit of {MAX_GENERATION_BODY_BYTES:,} bytes" in r.json()["error"]["message"]
    r = runner.client.post("/v1/embeddings", content=b'{"input": "' + b"a" * (5 * 1024 * 1024) + b'"}',
                           headers={"content-type": "application/json"})
    assert r.status_code == 413 and f"limit of {MAX_BODY_BYTES:,} bytes" in r.json()["error"]["message"]
    assert_serving(runner)


def test_unknown_path_and_wrong_method(runner):
    assert runner.client.get("/v1/nothing").status_code == 404
    assert runner.client.get("/v1/completions").status_code == 405
    assert_serving(runner)


def test_metrics_names(runner):
    runner.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    text = runner.client.get("/metrics").text
    for name in ["llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total", "llamacpp:n_decode_total",
                 "llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:kv_cache_usage_ratio",
                 "hearth:kv_cells_used", "hearth:kv_cells_total 2048", "hearth:preemptions_total",
                 "hearth:requests_running", "hearth:requests_waiting", 'hearth:ttft_seconds_bucket{class="default"',
                 'hearth:tpot_seconds_bucket{class="default"']:
        assert name in text, name
    assert "_created" not in text


def _wait_idle(runner, timeout_s=5.0) -> float:
    """Seconds until every slot is idle and no KV cell is held."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        slots = runner.client.get("/slots").json()
        if not any(s["is_processing"] for s in slots) and runner.metric("hearth:kv_cells_used") == 0:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"still busy after {timeout_s} s: {runner.client.get('/slots').json()}")


def test_client_disconnect_during_stream_frees_its_slot(runner):
    body = json.dumps({"prompt": "Tell me a very long story.", "max_tokens": 1000, "ignore_eos": True,
                       "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", runner.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while got.count(b"data: ") < 3:
            got += s.recv(4096)
        assert any(sl["is_processing"] for sl in runner.client.get("/slots").json())
    _wait_idle(runner)
    assert_serving(runner)


def test_client_disconnect_while_waiting_for_a_non_stream_answer_frees_its_slot(runner):
    body = json.dumps({"prompt": "Tell me a very long story.", "max_tokens": 1000, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", runner.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 10
        while not any(sl["n_decoded"] > 2 for sl in runner.client.get("/slots").json()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    _wait_idle(runner)
    assert_serving(runner)


def test_preemption_under_a_tiny_kv_cache_over_http(start_runner):
    small = start_runner("--ctx", "512", "--parallel", "8")
    results = [None] * 8

    def ask(i):
        with httpx.Client(base_url=small.url, timeout=300) as c:
            results[i] = c.post("/v1/completions", json={
                "prompt": f"Story number {i}: the lighthouse keeper and the seagull. " * 2,
                "max_tokens": 90, "temperature": 0, "ignore_eos": True, "priority": i % 3,
            })

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None and r.status_code == 200 for r in results), [r and r.text for r in results]
    assert [r.json()["usage"]["completion_tokens"] for r in results] == [90] * 8
    assert small.metric("hearth:preemptions_total") > 0
    assert sum(r.json()["timings"]["num_preemptions"] for r in results) == small.metric("hearth:preemptions_total")


def test_queue_full_is_503_with_retry_after(start_runner):
    tight = start_runner("--ctx", "1024", "--parallel", "1", "--max-waiting", "1")
    held = []

    def occupy(max_tokens):
        with httpx.Client(base_url=tight.url, timeout=600) as c:
            held.append(c.post("/v1/completions", json={"prompt": "Go on.", "max_tokens": max_tokens,
                                                        "ignore_eos": True}).status_code)

    # Only the first must outlast the steps below; the queued one is short, so a loaded box finishes both.
    threads = [threading.Thread(target=occupy, args=(n,)) for n in (400, 4)]
    # The first one runs in the only slot, the second one waits in the only queue place.
    threads[0].start()
    wait_until(lambda: tight.metric("hearth:requests_running") == 1, 10, "the first request never ran")
    threads[1].start()
    wait_until(lambda: tight.metric("hearth:requests_waiting") == 1, 10, "the second request never queued")
    r = tight.client.post("/v1/completions", json={"prompt": "Me too", "max_tokens": 4})
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"
    for t in threads:
        t.join()
    assert held == [200, 200]
    assert_serving(tight)


def test_a_file_that_is_not_a_model_is_reported_by_health(tmp_path, runner_class):
    junk = tmp_path / "notes.gguf"
    junk.write_bytes(b"this is not a GGUF file" * 100)
    runner = runner_class(junk, tmp_path / "runner.log")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                h = runner.client.get("/health")
                if h.status_code != 503:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert h.status_code == 500
        assert "could not load" in h.json()["error"]["message"]
        r = runner.client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 500 and "failed to load" in r.json()["error"]["message"]
    finally:
        runner.stop()


def test_prefix_cache_reuse_is_reported_in_usage_timings_props_and_metrics(start_runner):
    runner = start_runner("--ctx", "2048", "--parallel", "2")
    system = "You are a helpful assistant of a family home. " * 20
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
            "max_tokens": 4, "temperature": 0}
    first = runner.client.post("/v1/chat/completions", json=body).json()
    second = runner.client.post("/v1/chat/completions", json=body).json()
    n_prompt = second["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - 1
    assert second["timings"]["cache_n"] == n_prompt - 1 and second["timings"]["prompt_n"] == 1
    assert runner.metric("hearth:prefix_cache_hit_tokens_total") >= n_prompt - 1
    assert runner.metric("hearth:kv_cells_cached") > 0
    off = runner.client.post("/v1/chat/completions", json={**body, "cache_prompt": False}).json()
    assert off["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    props = runner.client.get("/props").json()["prefix_cache"]
    assert props["enabled"] and props["n_swa"] == 512 and "sliding window" in props["note"]


def test_a_runner_without_the_prefix_cache_says_so(start_runner):
    runner = start_runner("--ctx", "1024", "--parallel", "1", "--no-prefix-cache")
    props = runner.client.get("/props").json()["prefix_cache"]
    assert props["enabled"] is False and "setting" in props["note"]


def test_native_completion_honours_n_predict_and_llama_servers_fields(start_runner):
    # A runner of its own: on the shared one, after the earlier tests of this file, the streamed greedy
    # text came out ", there was a little" against the whole answer's ", there was a small" (alone: equal).
    runner = start_runner("--ctx", "2048", "--parallel", "4")
    r = runner.client.post("/completion", json={"prompt": "Once upon a time", "n_predict": 5, "temperature": 0,
                                                "return_tokens": True, "n_probs": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens_predicted"] == 5 and body["timings"]["predicted_n"] == 5 and len(body["tokens"]) == 5
    assert body["stop"] is True and body["stop_type"] == "limit"
    assert body["generation_settings"]["n_predict"] == 5
    probs = body["completion_probabilities"]
    assert len(probs) == 5 and all(len(p["top_logprobs"]) == 3 and p["logprob"] <= 0 for p in probs)
    assert [p["id"] for p in probs] == body["tokens"]
    # The same request streamed gives the same text in pieces, then a last object with stop set.
    with runner.client.stream("POST", "/completion", json={"prompt": "Once upon a time", "n_predict": 5,
                                                           "temperature": 0, "stream": True}) as resp:
        events = sse_events(resp)
    assert "".join(e["content"] for e in events) == body["content"]
    assert events[-1]["stop"] is True and all(e["stop"] is False for e in events[:-1])


def test_native_completion_with_a_grammar_and_several_prompts(runner):
    r = runner.client.post("/completion", json={"prompt": "Say a:", "grammar": 'root ::= "a"{3}', "n_predict": 8})
    assert r.status_code == 200 and r.json()["content"] == "aaa"
    bad = runner.client.post("/completion", json={"prompt": "x", "grammar": "root ::= (not gbnf", "n_predict": 2})
    assert bad.status_code == 400
    many = runner.client.post("/completion", json={"prompt": ["Hello", "Goodbye"], "n_predict": 2, "temperature": 0})
    assert many.status_code == 200 and [b["index"] for b in many.json()] == [0, 1]


def test_apply_template_tokenize_pieces_and_context_overflow(runner):
    prompt = runner.client.post("/apply-template", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert prompt["prompt"].endswith("<start_of_turn>model\n") and "Hi" in prompt["prompt"]
    pieces = runner.client.post("/tokenize", json={"content": "Hello world", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == "Hello world"
    r = runner.client.post("/completion", json={"prompt": "word " * 3000, "n_predict": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "exceed_context_size_error"
    assert err["n_ctx"] == 2048 and err["n_prompt_tokens"] > 2048


def test_chat_stream_starts_with_the_role_alone_and_carries_a_fingerprint(runner):
    with runner.client.stream("POST", "/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
    }) as resp:
        events = sse_events(resp)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all(e["choices"][0]["delta"].get("content") != "" for e in events[1:-1] if e["choices"])
    assert all(e["system_fingerprint"].startswith("b") for e in events[:-1])


def test_several_choices_and_a_continued_assistant_message(runner):
    r = runner.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 6
    turns = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]

    def count(**extra) -> int:
        resp = runner.client.post("/chat/completions/input_tokens", json={"messages": turns, **extra})
        assert resp.status_code == 200, resp.text
        return resp.json()["input_tokens"]

    # Continued: the prompt stops inside the assistant's turn, before its end-of-turn marker.
    assert count() == count(continue_final_message=True, add_generation_prompt=False)
    assert count() < count(add_generation_prompt=False)
    both = runner.client.post("/v1/chat/completions", json={"messages": turns, "continue_final_message": True,
                                                             "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    # Text parts of the continued message join with a blank line, as llama-server continues them; a
    # request's own `verbose` shows the prompt.
    parts = [{"type": "text", "text": "The colour"}, {"type": "text", "text": "is"}]
    r = runner.client.post("/chat/completions", json={"messages": [turns[0], {"role": "assistant", "content": parts}],
                                                      "max_tokens": 1, "verbose": True})
    assert r.status_code == 200, r.text
    assert r.json()["__verbose"]["prompt"].endswith("The colour\n\nis")
    assert "__verbose" not in runner.client.post("/chat/completions", json={"messages": turns, "max_tokens": 1}).json()


def test_return_progress_streams_prompt_progress(start_runner):
    # A prompt over several 32-token batches: a progress object before it and after each batch,
    # prompt timings that never go back (llama-server's return_progress), then the generated text.
    runner = start_runner("--ctx", "1024", "--parallel", "1", "--batch", "32")
    prompt = "the quick brown fox jumps over the lazy dog " * 8
    with runner.client.stream("POST", "/completion", json={"prompt": prompt, "n_predict": 3, "temperature": 0,
                                                           "stream": True, "return_progress": True}) as resp:
        events = sse_events(resp)
    progress = [e for e in events if "prompt_progress" in e]
    total = progress[0]["prompt_progress"]["total"]
    assert total > 64 and len(progress) >= 3
    assert progress[0]["prompt_progress"]["processed"] == 0 and progress[0]["timings"]["prompt_ms"] == 0.0
    assert progress[-1]["prompt_progress"]["processed"] == total
    done = [p["timings"]["prompt_ms"] for p in progress]
    assert done == sorted(done) and done[-1] > 0
    assert all(e["content"] == "" for e in progress)
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 3


def test_n_predict_is_the_limit_of_requests_naming_none_not_a_cap(start_runner):
    runner = start_runner("--ctx", "512", "--parallel", "1", "-n", "4")
    ask = {"prompt": "Once upon a time", "temperature": 0, "ignore_eos": True}
    assert runner.client.post("/completion", json=ask).json()["tokens_predicted"] == 4
    # As llama-server: a request's own limit wins, above -n too.
    assert runner.client.post("/completion", json={**ask, "n_predict": 6}).json()["tokens_predicted"] == 6


def test_timings_per_token_ride_every_streamed_piece(runner):
    body = {"messages": [{"role": "user", "content": "Count to three"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "stream": True, "timings_per_token": True}
    with runner.client.stream("POST", "/v1/chat/completions", json=body) as resp:
        events = [e for e in sse_events(resp) if e != "[DONE]"]
    pieces = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert pieces and all("timings" in e for e in pieces)
    counts = [e["timings"]["predicted_n"] for e in pieces]
    assert counts == sorted(counts) and all(e["timings"]["prompt_n"] > 0 for e in pieces)
