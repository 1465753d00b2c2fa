"""Anthropic's Messages API translated to and from OpenAI's chat shapes (no model needed)."""

import json

import pytest

from app.protocols.anthropic import MessageStream, to_chat, to_message
from app.protocols.openai import ApiError

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def events(raw: list[bytes]) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event."""
    out = []
    for block in raw:
        name, data = block.decode().strip().split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        out.append((payload["type"], payload))
    return out


def test_system_blocks_and_sampling_map_to_chat_fields():
    chat = to_chat({"system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                    "max_tokens": 7, "temperature": 0.2, "top_k": 5, "stop_sequences": ["END"], "stream": True,
                    "metadata": {"user_id": "u"}, "thinking": {"type": "enabled", "budget_tokens": 10}})
    assert chat["messages"] == [{"role": "system", "content": "Be brief.\nBe kind."},
                                {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert (chat["max_tokens"], chat["temperature"], chat["top_k"], chat["stop"], chat["stream"]) == (
        7, 0.2, 5, ["END"], True)
    assert "metadata" not in chat and "thinking" not in chat
    # Extended thinking with a budget: thinking on, the budget as llama-server's thinking_budget_tokens.
    assert chat["chat_template_kwargs"] == {"enable_thinking": True} and chat["thinking_budget_tokens"] == 10


def test_output_format_is_a_json_schema_constraint():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    chat = to_chat({"messages": [], "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def test_claude_codes_per_request_stamp_is_blanked_so_the_prefix_cache_holds():
    stamped = "x-anthropic-billing-header: cc_version=2.1; cch=a5145;You are Claude Code."
    chat = to_chat({"system": stamped, "messages": [{"role": "user", "content": "hi"}]})
    assert chat["messages"][0]["content"] == "x-anthropic-billing-header: cc_version=2.1; cch=fffff;You are Claude Code."


def test_tool_use_and_results_become_tool_calls_and_tool_messages_in_openai_order():
    chat = to_chat({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "text", "text": "Here:"},
                                     {"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "Sunny"}]}]},
    ]})
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                               "parameters": WEATHER["input_schema"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["messages"][1] == {"role": "assistant", "content": "Looking.", "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    # The result answers the assistant's call, so it comes before the user's own words.
    assert chat["messages"][2:] == [{"role": "tool", "tool_call_id": "t1", "content": "Sunny"},
                                    {"role": "user", "content": [{"type": "text", "text": "Here:"}]}]


@pytest.mark.parametrize("choice,expected", [({"type": "auto"}, "auto"), ({"type": "any"}, "required")])
def test_tool_choice_kinds(choice, expected):
    assert to_chat({"tools": [WEATHER], "tool_choice": choice, "messages": []})["tool_choice"] == expected


def test_tool_choice_none_offers_no_tools():
    chat = to_chat({"tools": [WEATHER], "tool_choice": {"type": "none"}, "messages": []})
    assert "tools" not in chat and chat["tool_choice"] == "none"


def test_an_empty_conversation_is_answered_as_an_empty_user_turn():
    assert to_chat({"messages": []})["messages"] == [{"role": "user", "content": ""}]


@pytest.mark.parametrize("body,status,words", [
    ({"max_tokens": 5}, 400, "'messages' is required"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "AA"}}]}]},
     400, "media_type and data"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     400, "base64 or url"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     400, "images go in user messages"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400, "'document'"),
    ({"messages": [{"role": "system", "content": "x"}]}, 400, "user or assistant"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}], "messages": []}, 400, "client tools"),
])
def test_what_cannot_be_honoured_is_refused_with_a_reason(body, status, words):
    with pytest.raises(ApiError) as exc:
        to_chat(body)
    assert exc.value.status == status and words in exc.value.message


def test_image_blocks_become_openai_image_parts_in_their_place():
    blocks = [{"type": "text", "text": "Is the garage door open?"},
              {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "/9j/AA=="}},
              {"type": "image", "source": {"type": "url", "url": "https://cam.local/snap.png"}}]
    assert to_chat({"messages": [{"role": "user", "content": blocks}]})["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "Is the garage door open?"},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/AA=="}},
        {"type": "image_url", "image_url": {"url": "https://cam.local/snap.png"}}]}]


def test_a_completion_becomes_a_message_with_blocks_and_anthropic_usage():
    chat = {"model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Calling.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 20}},
        "timings": {"prompt_n": 10}}
    msg = to_message(chat, "msg_1")
    assert msg["type"] == "message" and msg["role"] == "assistant" and "timings" not in msg
    assert msg["content"] == [{"type": "text", "text": "Calling."},
                              {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Oslo"}}]
    assert msg["stop_reason"] == "tool_use"
    assert msg["usage"] == {"input_tokens": 10, "cache_read_input_tokens": 20, "cache_creation_input_tokens": 0,
                            "output_tokens": 9}


@pytest.mark.parametrize("finish,reason", [("stop", "end_turn"), ("length", "max_tokens")])
def test_stop_reasons(finish, reason):
    chat = {"choices": [{"finish_reason": finish, "message": {"content": ""}}], "usage": {}}
    msg = to_message(chat, "msg_1")
    assert msg["stop_reason"] == reason and msg["content"] == []


def test_the_stream_opens_one_block_at_a_time_and_ends_with_the_stop_events():
    s = MessageStream("msg_1", "m", input_tokens=12)
    raw = []
    for chunk in [
        {"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"choices": [{"delta": {"content": "Let me"}, "finish_reason": None}]},
        {"choices": [{"delta": {"content": " look."}, "finish_reason": None}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                                "function": {"name": "get_weather", "arguments": ""}}]},
                      "finish_reason": None}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Rome"}'}}]},
                      "finish_reason": None}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}],
         "usage": {"prompt_tokens": 12, "completion_tokens": 8, "prompt_tokens_details": {"cached_tokens": 4}}},
    ]:
        raw += s.feed(chunk)
    got = events(raw)
    assert [name for name, _ in got] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    start = got[0][1]["message"]
    assert start["content"] == [] and start["usage"]["input_tokens"] == 12
    assert got[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert got[5][1]["index"] == 1 and got[5][1]["content_block"]["name"] == "get_weather"
    assert got[6][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Rome"}'}
    assert got[8][1]["delta"]["stop_reason"] == "tool_use"
    assert got[8][1]["usage"]["output_tokens"] == 8 and got[8][1]["usage"]["cache_read_input_tokens"] == 4


def test_an_error_in_the_stream_is_anthropics_error_event():
    s = MessageStream("msg_1", "m", input_tokens=1)
    s.feed({"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]})
    got = events(s.feed({"error": {"message": "engine stopped", "type": "server_error"}}))
    assert got == [("error", {"type": "error", "error": {"type": "api_error", "message": "engine stopped"}})]



def test_thinking_blocks_of_the_history_become_the_turns_reasoning_and_templates_render_it():
    from pathlib import Path

    from app.engine.chat import ChatTemplate
    from app.llama_tools import tools_cache_dir
    from app.protocols.openai import ChatBody, parse_body

    chat = to_chat({"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Paris, I guess.", "signature": "x"},
                                          {"type": "redacted_thinking", "data": "opaque"},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"}]},
    ]})
    assert chat["messages"][1]["reasoning_content"] == "Paris, I guess." and chat["messages"][1]["tool_calls"]
    # The chat body keeps it for the template (it was dropped as an unknown field before).
    body = parse_body(json.dumps(chat).encode(), ChatBody)[0]
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    assert messages[1]["reasoning_content"] == "Paris, I guess."
    # Qwen3's template shows the reasoning of turns after the last user query (as llama-server renders it).
    qwen3 = next(iter(sorted((tools_cache_dir() / "src").glob(
        "llama_cpp_python-*/vendor/llama.cpp/models/templates/Qwen-Qwen3-0.6B.jinja"))), None)
    if qwen3 is None:
        pytest.skip("llama.cpp's templates are unpacked by scripts/build_llama_tools.sh")
    prompt = ChatTemplate(Path(qwen3).read_text(), "", "<|im_end|>").render(messages, tools=body.tool_list)
    assert "<think>\nParis, I guess.\n</think>" in prompt
