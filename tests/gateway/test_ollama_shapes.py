"""Ollama ↔ OpenAI translation on fixed payloads: requests, whole answers, streamed answers, tool calls."""

import json

import pytest

from app.gateway.ollama import capabilities
from app.gateway.pipeline import translate_stream
from app.protocols.ollama import (
    ChatAdapter,
    EmbedAdapter,
    EmbeddingsAdapter,
    GenerateAdapter,
    chat_to_openai,
    format_to_response_format,
    generate_to_openai,
    hearth_name,
    messages_to_openai,
    ollama_name,
    options_to_openai,
    parse_keep_alive,
    tool_calls_from_openai,
)
from app.protocols.openai import ApiError

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": {"type": "object", "required": ["city"],
                                                                "properties": {"city": {"type": "string"}}}}}


def test_names_gain_and_lose_latest():
    assert ollama_name("gemma") == "gemma:latest" and ollama_name("qwen:7b") == "qwen:7b"
    known = {"gemma", "qwen:7b"}
    assert hearth_name("gemma:latest", known) == "gemma"
    assert hearth_name("gemma", known) == "gemma" and hearth_name("qwen:7b", known) == "qwen:7b"
    assert hearth_name("gemma:7b", known) == "gemma:7b"  # another tag is another model (not found later)


@pytest.mark.parametrize("value, seconds", [
    (None, None), ("", None), (0, 0.0), ("0", 0.0), (300, 300.0), ("5m", 300.0), ("1h30m", 5400.0),
    ("90s", 90.0), ("1.5h", 5400.0), ("250ms", 0.25), (-1, float("inf")), ("-1", float("inf")),
    ("-1m", float("inf")), (2.5, 2.5),
])
def test_keep_alive_durations(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "5x", True, [1]])
def test_bad_keep_alive_is_a_400(value):
    with pytest.raises(ApiError) as e:
        parse_keep_alive(value)
    assert e.value.status == 400 and e.value.param == "keep_alive"


def test_options_map_onto_openai_names():
    out = options_to_openai({"temperature": 0.2, "top_p": 0.5, "top_k": 7, "num_predict": 12, "num_ctx": 8192,
                             "stop": ["\n"], "seed": 3, "repeat_penalty": 1.1, "mirostat": 2})
    assert out == {"temperature": 0.2, "top_p": 0.5, "top_k": 7, "max_tokens": 12, "stop": ["\n"], "seed": 3,
                   "repeat_penalty": 1.1}
    assert "max_tokens" not in options_to_openai({"num_predict": -1})  # no limit: the class default
    assert options_to_openai(None) == {}


def test_format_json_and_schema():
    assert format_to_response_format("json") == {"type": "json_object"}
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    assert format_to_response_format(schema) == {
        "type": "json_schema", "json_schema": {"name": "ollama_format", "schema": schema, "strict": True}}
    assert format_to_response_format("") is None and format_to_response_format(None) is None
    with pytest.raises(ApiError):
        format_to_response_format("yaml")


def test_chat_request_with_tools_and_format():
    body = {"model": "gemma:latest", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER_TOOL], "format": "json", "options": {"num_predict": 5}}
    out = chat_to_openai(body)
    assert out == {"model": "gemma:latest", "stream": True, "stream_options": {"include_usage": True},
                   "max_tokens": 5, "response_format": {"type": "json_object"},
                   "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER_TOOL]}
    assert chat_to_openai({**body, "stream": False})["stream"] is False


def test_tool_call_history_gets_ids_and_string_arguments():
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"function": {"name": "get_time", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_name": "get_time", "content": "10:00"},
        {"role": "tool", "content": "sunny"},
    ]
    out = messages_to_openai(messages, "gemma")
    calls = out[1]["tool_calls"]
    assert calls == [
        {"id": "call_1_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_1_1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Rome"}'}},
    ]
    # The named result answers its call; the unnamed one the call still open.
    assert out[2] == {"role": "tool", "content": "10:00", "tool_call_id": "call_1_1", "name": "get_time"}
    assert out[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1_0"}


def test_images_become_openai_image_parts_before_the_text():
    out = messages_to_openai([{"role": "user", "content": "What is this?", "images": ["iVBORw0KGgo=", "/9j/"]}],
                             "gemma")
    assert out == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "iVBORw0KGgo="}}, {"type": "image_url", "image_url": {"url": "/9j/"}},
        {"type": "text", "text": "What is this?"}]}]
    body, path = generate_to_openai({"model": "gemma", "prompt": "What is this?", "images": ["iVBORw0KGgo="]})
    assert path == "/v1/chat/completions"
    assert body["messages"][-1]["content"][0] == {"type": "image_url", "image_url": {"url": "iVBORw0KGgo="}}
    with pytest.raises(ApiError, match="need the chat template"):
        generate_to_openai({"model": "gemma", "prompt": "x", "raw": True, "images": ["iVBORw0KGgo="]})
    with pytest.raises(ApiError, match="list of base64 strings"):
        messages_to_openai([{"role": "user", "content": "x", "images": "iVBORw0KGgo="}], "gemma")


def test_generate_templated_raw_and_suffix():
    out, path = generate_to_openai({"model": "m", "prompt": "Hi", "system": "Be brief.", "stream": False})
    assert path == "/v1/chat/completions"
    assert out["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out, path = generate_to_openai({"model": "m", "prompt": "<start_of_turn>user\nHi", "raw": True})
    assert path == "/v1/completions" and out["prompt"] == "<start_of_turn>user\nHi"
    out, path = generate_to_openai({"model": "m", "prompt": "def add(a, b):\n    ", "suffix": "\n    return c"})
    assert path == "/v1/completions" and out["suffix"] == "\n    return c"


def test_tool_call_arguments_become_objects():
    calls = [{"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert tool_calls_from_openai(calls) == [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    with pytest.raises(ValueError, match="not JSON"):
        tool_calls_from_openai([{"function": {"name": "f", "arguments": "{city"}}])
    with pytest.raises(ValueError, match="not a JSON object"):
        tool_calls_from_openai([{"function": {"name": "f", "arguments": "[1]"}}])


CHAT_COMPLETION = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "gemma",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]}}],
    "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
    "timings": {"ttft_ms": 20.0, "total_ms": 90.0},
}


def test_whole_chat_answer():
    out = ChatAdapter({"model": "gemma:latest"}).answer(CHAT_COMPLETION)
    assert out["model"] == "gemma:latest" and out["done"] is True and out["done_reason"] == "stop"
    assert out["message"] == {"role": "assistant", "content": "",
                              "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert out["prompt_eval_count"] == 11 and out["eval_count"] == 7
    assert out["prompt_eval_duration"] == 20_000_000 and out["eval_duration"] == 70_000_000
    assert out["created_at"].endswith("Z")


def test_whole_generate_answer_and_errors():
    completion = {"choices": [{"index": 0, "text": " Paris.", "finish_reason": "length"}],
                  "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    out = GenerateAdapter({"model": "m"}).answer(completion)
    assert out["response"] == " Paris." and out["done_reason"] == "length" and "message" not in out
    assert ChatAdapter({"model": "m"}).error(ApiError(503, "the model is still loading")) == (
        503, {"error": "the model is still loading"})
    bad_call = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{city"}}]}}]}
    assert "not JSON" in ChatAdapter({"model": "m"}).answer(bad_call)["error"]


def sse(*payloads) -> list[bytes]:
    """SSE events cut at awkward places, as the network may deliver them."""
    raw = b"".join(b"data: " + json.dumps(p).encode() + b"\n\n" for p in payloads) + b"data: [DONE]\n\n"
    return [raw[i:i + 37] for i in range(0, len(raw), 37)]


def ndjson_lines(adapter, events) -> list[dict]:
    """The adapter's stream for these SSE bytes, as the gateway relays it, one object a line."""
    return [json.loads(x) for x in b"".join(translate_stream(adapter, iter(events))).splitlines()]


def chunk(delta=None, finish=None, **extra):
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}],
            **extra}


def test_streamed_chat_is_ndjson():
    events = sse(chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}), chunk({"content": "lo"}),
                 chunk(finish="length", usage={"prompt_tokens": 3, "completion_tokens": 2}, timings={"ttft_ms": 5}),
                 {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    lines = ndjson_lines(ChatAdapter({"model": "m"}), events)
    assert [x["message"]["content"] for x in lines] == ["Hel", "lo", ""]
    assert [x["done"] for x in lines] == [False, False, True]
    assert lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 2


def test_streamed_tool_call_deltas_arrive_whole():
    events = sse(chunk({"role": "assistant"}),
                 chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                        "function": {"name": "get_weather", "arguments": ""}}]}),
                 chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
                 chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
                 chunk(finish="tool_calls", usage={"prompt_tokens": 3, "completion_tokens": 9}))
    lines = ndjson_lines(ChatAdapter({"model": "m"}), events)
    assert lines[0]["message"]["tool_calls"] == [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert lines[0]["done"] is False and lines[1]["done"] is True and lines[1]["done_reason"] == "stop"


def test_streamed_generate_and_a_runner_error_mid_stream():
    events = sse({"choices": [{"index": 0, "text": " Par", "finish_reason": None}]},
                 {"choices": [{"index": 0, "text": "is", "finish_reason": "stop"}], "usage": {"completion_tokens": 2}})
    lines = ndjson_lines(GenerateAdapter({"model": "m"}), events)
    assert [x["response"] for x in lines] == [" Par", "is", ""] and lines[-1]["done"]
    broken = sse(chunk({"content": "Hel"}), {"error": {"message": "the runner stopped mid-stream", "code": "runner_failed"}})
    lines = ndjson_lines(ChatAdapter({"model": "m"}), broken)
    assert lines[-1] == {"error": "the runner stopped mid-stream"}
    cut = sse(chunk({"content": "Hel"}))[:-1]  # ends without a finish reason
    lines = ndjson_lines(ChatAdapter({"model": "m"}), cut)
    assert "error" in lines[-1]


def test_embeddings_in_both_of_ollamas_shapes():
    body = {"model": "e:latest", "input": ["a", "b"], "prompt": "c", "truncate": False}
    assert EmbedAdapter(body).to_openai() == {"model": "e:latest", "input": ["a", "b"], "truncate": False}
    assert EmbeddingsAdapter(body).to_openai()["input"] == "c"
    answer = {"data": [{"index": 1, "embedding": [0.0, 1.0]}, {"index": 0, "embedding": [1.0, 0.0]}],
              "usage": {"prompt_tokens": 4}}
    out = EmbedAdapter(body).answer(answer)
    assert out["embeddings"] == [[1.0, 0.0], [0.0, 1.0]] and out["prompt_eval_count"] == 4 and out["model"] == "e:latest"
    assert EmbeddingsAdapter(body).answer(answer) == {"embedding": [1.0, 0.0]}


def test_capabilities_from_the_header():
    gen = {"general.architecture": "gemma3", "tokenizer.ggml.fim_pre_token_id": 1}
    assert capabilities(gen, "{% if tools %}...{% endif %}") == ["completion", "tools", "insert", "embedding"]
    assert capabilities({"general.architecture": "bert", "bert.pooling_type": 2}, None) == ["embedding"]
