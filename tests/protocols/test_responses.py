"""OpenAI's Responses API translated to and from OpenAI's chat shapes (no model needed)."""

import json

import pytest

from app.protocols.openai import ApiError
from app.protocols.responses import ResponseStream, to_chat, to_response


def events(raw: list[bytes]) -> list[dict]:
    """The data of each server-sent event, checked against its event name."""
    out = []
    for block in raw:
        name, data = block.decode().strip().split("\n")
        payload = json.loads(data[len("data: "):])
        assert name == f"event: {payload['type']}"
        out.append(payload)
    return out


def test_string_input_with_instructions():
    chat = to_chat({"instructions": "Be brief.", "input": "Hi", "max_output_tokens": 8, "temperature": 0.3})
    assert chat == {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                    "max_tokens": 8, "temperature": 0.3}


def test_items_with_function_calls_and_outputs():
    chat = to_chat({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Snow"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
    ], "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}},
                 {"type": "web_search"}],
       "tool_choice": {"type": "function", "name": "weather"},
       "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}}})
    assert chat["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Snow"},
    ]
    # A built-in tool has no chat equivalent and is skipped, as llama-server skips it.
    assert chat["tools"] == [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True}}


@pytest.mark.parametrize("body,status,words", [
    ({"input": "hi", "previous_response_id": "resp_1"}, 400, "stateless"),
    ({}, 400, "'input' is required"),
    ({"input": 5}, 400, "string or a list"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]}, 400,
     "file_id is not supported"),
    ({"input": [{"type": "computer_call"}]}, 400, "'computer_call'"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, 400,
     "images go in user messages"),
])
def test_refusals(body, status, words):
    with pytest.raises(ApiError) as exc:
        to_chat(body)
    assert exc.value.status == status and words in exc.value.message


def test_input_images_become_openai_image_parts():
    body = {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Who is at the door?"},
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "auto"}]}]}
    assert to_chat(body)["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "Who is at the door?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]


def test_a_completion_becomes_a_response_with_output_items():
    chat = {"model": "m", "created": 5, "choices": [{"finish_reason": "tool_calls", "message": {
        "content": "Sure.", "tool_calls": [{"id": "c9", "function": {"name": "weather", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}}
    resp = to_response(chat, {"input": "x"}, "resp_1")
    assert resp["id"] == "resp_1" and resp["object"] == "response" and resp["status"] == "completed"
    msg, call = resp["output"]
    assert msg["id"].startswith("msg_") and msg["content"][0]["text"] == "Sure."
    assert call == {"id": "fc_c9", "type": "function_call", "status": "completed", "call_id": "c9",
                    "name": "weather", "arguments": "{}"}
    assert resp["usage"]["input_tokens"] == 7 and resp["usage"]["total_tokens"] == 10
    assert resp["usage"]["input_tokens_details"] == {"cached_tokens": 2}


def test_the_stream_numbers_its_events_and_completes_with_the_whole_output():
    s = ResponseStream("resp_1", {"input": "x"}, "m")
    raw = s.start()
    for chunk in [
        {"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"choices": [{"delta": {"content": "He"}, "finish_reason": None}]},
        {"choices": [{"delta": {"content": "llo"}, "finish_reason": None}]},
        {"choices": [{"delta": {}, "finish_reason": "length"}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
    ]:
        raw += s.feed(chunk)
    got = events(raw)
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    msg_id = got[2]["item"]["id"]
    assert all(e["item_id"] == msg_id for e in got[3:8])
    done = got[-1]["response"]
    assert done["output"][0]["content"][0]["text"] == "Hello" and done["usage"]["output_tokens"] == 2



def test_llama_servers_telemetry_rides_the_events_it_belongs_to():
    # return_progress: prompt progress comes as in_progress events; timings_per_token: each text delta
    # carries the timings so far, and the completed event the final ones.
    s = ResponseStream("resp_1", {"input": "x"}, "m")
    raw = s.start()
    progress = {"total": 40, "cache": 0, "processed": 32, "time_ms": 90.0}
    timings = {"prompt_n": 40, "prompt_per_second": 400.0, "predicted_n": 1, "predicted_per_second": 0.0}
    raw += s.feed({"choices": [{"delta": {}, "finish_reason": None}], "prompt_progress": progress, "timings": timings})
    raw += s.feed({"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}], "timings": timings})
    raw += s.feed({"choices": [{"delta": {}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 40, "completion_tokens": 1},
                   "timings": {**timings, "predicted_per_second": 20.0}})
    got = events(raw)
    assert got[2]["type"] == "response.in_progress" and got[2]["prompt_progress"] == progress
    delta = next(e for e in got if e["type"] == "response.output_text.delta")
    assert delta["timings"] == timings
    assert got[-1]["type"] == "response.completed" and got[-1]["timings"]["predicted_per_second"] == 20.0
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
