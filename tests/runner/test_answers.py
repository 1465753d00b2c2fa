"""The runner's answer shapes on the fake model, streamed and whole: chat, text, native, n > 1, several prompts."""

from __future__ import annotations

import json

from tests.runner.streams import loads, payloads

HI = {"messages": [{"role": "user", "content": "Say hi"}], "temperature": 0}
REPLIES = {"Say hi": "Hello there", "Count": "one, two, three, four", "Weather?": '{"name": "get_weather", '
           '"arguments": {"city": "Paris"}}'}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def input_tokens(c, body: dict) -> int:
    return loads(c.post("/v1/chat/completions/input_tokens", json=body))["input_tokens"]


def test_a_whole_chat_answer_has_openais_fields_usage_and_llama_servers_timings(make_runner):
    c = make_runner(replies=REPLIES)
    out = loads(c.post("/v1/chat/completions", json=HI))
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert (out["model"], out["system_fingerprint"], out["hearth_class"]) == ("fake.gguf", "b0-hearth", "default")
    assert out["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello there"},
                               "logprobs": None, "finish_reason": "stop"}]
    n_prompt = input_tokens(c, HI)
    assert out["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 11, "total_tokens": n_prompt + 11,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    assert (out["timings"]["prompt_n"], out["timings"]["predicted_n"]) == (n_prompt, 11)


def test_a_streamed_chat_answer_opens_with_the_role_and_ends_with_usage_and_done(make_runner):
    c = make_runner(replies=REPLIES)
    events = payloads(c.post("/v1/chat/completions", json={**HI, "stream": True,
                                                           "stream_options": {"include_usage": True}}))
    first, *pieces, final, usage, done = events
    assert done == "[DONE]"
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": None}, "logprobs": None,
                                 "finish_reason": None}]
    assert "".join(p["choices"][0]["delta"]["content"] for p in pieces) == "Hello there"
    assert {e["object"] for e in events[:-1]} == {"chat.completion.chunk"} and len({e["id"] for e in events[:-1]}) == 1
    assert final["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert final["usage"]["completion_tokens"] == 11 and final["timings"]["predicted_n"] == 11
    assert usage["choices"] == [] and usage["usage"] == final["usage"]


def test_chat_logprobs_cover_every_token_whole_and_streamed(make_runner):
    c = make_runner(replies=REPLIES)
    body = {**HI, "logprobs": True, "top_logprobs": 2}
    whole = loads(c.post("/v1/chat/completions", json=body))["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in whole) == "Hello there"
    assert all(len(e["top_logprobs"]) == 2 for e in whole)
    streamed = [e for p in payloads(c.post("/v1/chat/completions", json={**body, "stream": True}))[1:-1]
                for e in (p["choices"][0]["logprobs"] or {}).get("content", [])]
    assert streamed == whole


def test_tool_calls_are_parsed_whole_and_streamed_in_openais_shape(make_runner):
    c = make_runner(replies=REPLIES)
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER_TOOL], "temperature": 0}
    choice = loads(c.post("/v1/chat/completions", json=body))["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    events = payloads(c.post("/v1/chat/completions", json={**body, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events[1:-1]]
    named, args = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert named["id"] and named["function"] == {"name": "get_weather", "arguments": ""}
    assert json.loads(args["function"]["arguments"]) == {"city": "Paris"}
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_text_completion_stops_at_a_stop_string_whole_and_streamed(make_runner):
    c = make_runner(replies=REPLIES)
    body = {"prompt": "Count", "stop": [", three"], "temperature": 0}
    out = loads(c.post("/v1/completions", json=body))
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["choices"] == [{"index": 0, "text": "one, two", "logprobs": None, "finish_reason": "stop"}]
    events = payloads(c.post("/v1/completions", json={**body, "stream": True}))
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "one, two"
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-2]["usage"]["completion_tokens"] >= 8


def test_n_choices_are_merged_into_one_answer_with_their_usage_summed(make_runner):
    c = make_runner(replies=REPLIES)
    out = loads(c.post("/v1/chat/completions", json={**HI, "n": 3}))
    assert [ch["index"] for ch in out["choices"]] == [0, 1, 2]
    assert {ch["message"]["content"] for ch in out["choices"]} == {"Hello there"}
    assert out["usage"]["completion_tokens"] == 33
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 33
    r = c.post("/v1/chat/completions", json={**HI, "n": 3, "stream": True})
    assert r.status_code == 400 and r.json["error"]["param"] == "n"


def test_a_whole_native_completion_names_its_stop_word_slot_and_tokens(make_runner):
    c = make_runner(replies=REPLIES)
    out = loads(c.post("/completion", json={"prompt": "Count", "stop": [", three"], "return_tokens": True,
                                            "temperature": 0}))
    assert (out["content"], out["stop"], out["stop_type"], out["stopping_word"]) == ("one, two", True, "word", ", three")
    # The tokens are those generated, the stop string's own included (it ended generation, its text is cut).
    assert bytes(t - 100 for t in out["tokens"]).decode().startswith("one, two")
    assert out["id_slot"] >= 0 and out["tokens_predicted"] == len(out["tokens"])
    assert out["generation_settings"]["stop"] == [", three"] and out["prompt"] == "<s>Count"
    limited = loads(c.post("/completion", json={"prompt": "Count", "n_predict": 3, "temperature": 0}))
    assert (limited["content"], limited["stop_type"], limited["stopping_word"]) == ("one", "limit", "")


def test_a_streamed_native_completion_sends_pieces_then_the_last_object_and_no_done(make_runner):
    c = make_runner(replies=REPLIES)
    events = payloads(c.post("/completion", json={"prompt": "Count", "n_predict": 6, "stream": True,
                                                  "return_tokens": True, "timings_per_token": True,
                                                  "temperature": 0}))
    *pieces, last = events
    assert "[DONE]" not in events
    assert "".join(p["content"] for p in pieces) == "one, t"
    assert [p["tokens_predicted"] for p in pieces] == list(range(1, 7))
    assert [t for p in pieces for t in p["tokens"]] == [100 + b for b in b"one, t"]
    assert [p["timings"]["predicted_n"] for p in pieces] == list(range(1, 7))
    assert all(not p["stop"] and p["id_slot"] >= 0 for p in pieces)
    assert last["stop"] and last["content"] == "" and last["tokens"] == [] and last["stop_type"] == "limit"


def test_several_native_prompts_are_answered_as_a_list_in_their_order(make_runner):
    c = make_runner(replies=REPLIES)
    out = c.post("/completion", json={"prompt": ["Say hi", "Count"], "temperature": 0})
    assert out.status_code == 200
    answers = out.json
    assert [a["index"] for a in answers] == [0, 1]
    assert [a["content"] for a in answers] == ["Hello there", "one, two, three, four"]
    assert c.post("/completion", json={"prompt": ["a", "b"], "stream": True}).status_code == 400


def test_return_progress_streams_the_prompts_progress_before_the_text(make_runner):
    c = make_runner(replies=REPLIES)
    events = payloads(c.post("/v1/chat/completions", json={**HI, "stream": True, "return_progress": True}))
    progress = [e for e in events[:-1] if "prompt_progress" in e]
    assert progress and progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]
    assert set(progress[0]["prompt_progress"]) == {"total", "cache", "processed", "time_ms"}
    assert all(e["choices"][0]["delta"] == {} for e in progress)
