"""Anthropic's Messages and OpenAI's Responses APIs on the runner, from its own engine events (fake model)."""

from __future__ import annotations

from tests.runner.streams import loads, sse_events

REPLIES = {"Say hi": "Hello there", "Weather?": '{"name": "get_weather", "arguments": {"city": "Oslo"}}'}
SAY_HI = [{"role": "user", "content": "Say hi"}]
WEATHER = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
# A template that shows whether thinking is on: --reasoning and chat_template_kwargs both change the prompt.
THINKING_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                     "{% if enable_thinking %}<think>\n{% endif %}{% if add_generation_prompt %}<assistant>{% endif %}")


def chat_input_tokens(c, **extra) -> int:
    return loads(c.post("/v1/chat/completions/input_tokens", json={"messages": SAY_HI, **extra}))["input_tokens"]


def test_a_whole_message_is_built_from_the_chat_answer(make_runner):
    c = make_runner(replies=REPLIES)
    msg = loads(c.post("/v1/messages", json={"model": "claude-any", "max_tokens": 64, "messages": SAY_HI}))
    assert msg["type"] == "message" and msg["id"].startswith("msg_") and msg["model"] == "fake.gguf"
    assert msg["content"] == [{"type": "text", "text": "Hello there"}] and msg["stop_reason"] == "end_turn"
    usage = msg["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == chat_input_tokens(c)
    assert usage["output_tokens"] == 11


def test_a_streamed_message_is_anthropics_events_with_the_prompts_size_up_front(make_runner):
    c = make_runner(replies=REPLIES)
    r = c.post("/v1/messages", json={"max_tokens": 64, "messages": SAY_HI, "stream": True})
    assert r.mimetype == "text/event-stream"
    events = sse_events(r)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["model"] == "fake.gguf" and start["usage"]["input_tokens"] == chat_input_tokens(c)
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == "Hello there"
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn" and events[-2][1]["usage"]["output_tokens"] == 11


def test_a_streamed_message_renders_and_tokenizes_its_prompt_once(make_runner):
    c = make_runner(replies=REPLIES)
    model = c.application.state.model
    calls = []
    tokenize = model.tokenize
    model.tokenize = lambda text, *a, **k: calls.append(text) or tokenize(text, *a, **k)
    sse_events(c.post("/v1/messages", json={"max_tokens": 8, "messages": SAY_HI, "stream": True}))
    assert len(calls) == 1 and "Say hi" in calls[0]


def test_a_tool_call_is_a_tool_use_block_whole_and_streamed(make_runner):
    c = make_runner(replies=REPLIES)
    body = {"max_tokens": 64, "tools": [WEATHER], "messages": [{"role": "user", "content": "Weather?"}]}
    msg = loads(c.post("/v1/messages", json=body))
    assert msg["stop_reason"] == "tool_use"
    (block,) = msg["content"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {"city": "Oslo"}
    events = sse_events(c.post("/v1/messages", json={**body, "stream": True}))
    opened = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["type"] for b in opened] == ["tool_use"] and opened[0]["name"] == "get_weather"
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_errors_on_messages_take_anthropics_shape(make_runner):
    c = make_runner(replies=REPLIES, n_ctx=64)
    r = c.post("/v1/messages", json={"max_tokens": 8, "messages": [{"role": "user", "content": "x" * 200}]})
    assert r.status_code == 400
    assert r.json["type"] == "error" and r.json["error"]["type"] == "invalid_request_error"
    assert "exceeds the available context size" in r.json["error"]["message"]


def test_a_whole_response_has_a_message_item_and_usage(make_runner):
    c = make_runner(replies=REPLIES)
    resp = loads(c.post("/v1/responses", json={"model": "gpt-any", "input": "Say hi", "max_output_tokens": 64}))
    assert resp["object"] == "response" and resp["status"] == "completed" and resp["model"] == "fake.gguf"
    (item,) = resp["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == "Hello there"
    assert resp["usage"]["input_tokens"] == chat_input_tokens(c) and resp["usage"]["output_tokens"] == 11


def test_a_streamed_response_numbers_its_events_and_completes(make_runner):
    c = make_runner(replies=REPLIES)
    events = sse_events(c.post("/v1/responses", json={"input": "Say hi", "stream": True}))
    names = [name for name, _ in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-1] == "response.completed" and "[DONE]" not in [d for _, d in events]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert "".join(d["delta"] for n, d in events if n == "response.output_text.delta") == "Hello there"
    done = events[-1][1]["response"]
    assert done["output"][0]["content"][0]["text"] == "Hello there" and done["usage"]["output_tokens"] == 11


def test_token_counts_are_the_prompt_the_chat_route_runs_reasoning_default_and_template_kwargs_included(make_runner):
    c = make_runner(replies=REPLIES, template=THINKING_TEMPLATE, reasoning="off")
    off = chat_input_tokens(c)
    assert off == chat_input_tokens(c, chat_template_kwargs={"enable_thinking": False})
    assert chat_input_tokens(c, chat_template_kwargs={"enable_thinking": True}) == off + len("<think>\n")
    counted = loads(c.post("/v1/messages/count_tokens", json={"messages": SAY_HI}))["input_tokens"]
    responses = loads(c.post("/v1/responses/input_tokens", json={"input": "Say hi"}))
    assert counted == responses["input_tokens"] == off
    ran = loads(c.post("/v1/chat/completions", json={"messages": SAY_HI, "max_tokens": 1}))
    assert ran["usage"]["prompt_tokens"] == off
