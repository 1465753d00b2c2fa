"""Thinking in the Ollama, Anthropic and Responses adapters on OpenAI's chat shapes (no model): the request's
controls as C2's fields, thoughts of the history as reasoning_content, and answers fed as a runner would
send them — including a stock runner that thinks although asked not to, and an answer cut mid-thought."""

from __future__ import annotations

import json

import pytest

from app.protocols import anthropic, ollama, responses
from app.protocols.openai import ApiError, ChatBody
from app.protocols.sse import events
from app.protocols.thinking import class_thinking, says_thinking, with_thinking

HI = [{"role": "user", "content": "Hi?"}]


def chunk(finish: str | None = None, usage: dict | None = None, **delta) -> dict:
    """An OpenAI chat.completion.chunk with one choice."""
    out = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        out["usage"] = usage
    return out


def completion(reasoning: str, content: str, usage: dict | None = None, finish: str = "stop") -> dict:
    message = {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {})}
    return {"object": "chat.completion", "model": "m", "created": 0,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": usage or {"prompt_tokens": 5, "completion_tokens": 9}}


THOUGHTFUL = [chunk(role="assistant", content=None), chunk(reasoning_content="Let "),
              chunk(reasoning_content="me see."), chunk(content="Hello"), chunk(content=" there"),
              chunk("stop", {"prompt_tokens": 5, "completion_tokens": 9,
                             "completion_tokens_details": {"reasoning_tokens": 4}})]


def feed(adapter, chunks: list[dict]) -> list[bytes]:
    out = adapter.start()
    for c in chunks:
        out += adapter.feed(c)
    return out + adapter.end()


# -- requests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("think", "fields"), [
    (False, {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "none"}),
    (True, {"chat_template_kwargs": {"enable_thinking": True}}),
    ("low", {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "low"}),
    ("high", {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "high"}),
])
def test_ollamas_think_becomes_c2s_fields_for_chat_and_generate(think, fields):
    chat = ollama.ChatAdapter({"model": "m", "messages": HI, "think": think}).to_openai()
    generate = ollama.GenerateAdapter({"model": "m", "prompt": "Hi?", "think": think}).to_openai()
    for body in (chat, generate):
        assert {k: body[k] for k in fields} == fields
        ChatBody.model_validate(body)  # the runner's own schema takes it
    assert "think" not in ollama.ChatAdapter({"model": "m", "messages": HI}).to_openai()


def test_ollama_refuses_a_think_value_it_does_not_know_and_raw_prompts_get_no_fields():
    with pytest.raises(ApiError, match="'think' must be true, false"):
        ollama.ChatAdapter({"model": "m", "messages": HI, "think": "max"}).to_openai()
    raw = ollama.GenerateAdapter({"model": "m", "prompt": "Hi", "raw": True, "think": True})
    assert raw.path == "/v1/completions" and "chat_template_kwargs" not in raw.to_openai()


@pytest.mark.parametrize(("thinking", "fields"), [
    ({"type": "enabled", "budget_tokens": 2048}, {"chat_template_kwargs": {"enable_thinking": True},
                                                  "thinking_budget_tokens": 2048}),
    ({"type": "adaptive"}, {"chat_template_kwargs": {"enable_thinking": True}}),
    ({"type": "disabled"}, {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "none"}),
])
def test_anthropics_thinking_becomes_c2s_fields(thinking, fields):
    chat = anthropic.MessagesAdapter({"model": "m", "max_tokens": 8, "messages": HI, "thinking": thinking}).to_openai()
    assert {k: chat[k] for k in fields} == fields and ChatBody.model_validate(chat).reasoning_budget == (
        fields.get("thinking_budget_tokens", -1))


@pytest.mark.parametrize("thinking", [{"type": "sometimes"}, {"type": "enabled", "budget_tokens": -5},
                                      {"type": "enabled", "budget_tokens": "lots"}, "on"])
def test_anthropic_refuses_a_thinking_it_cannot_read(thinking):
    with pytest.raises(ApiError) as err:
        anthropic.to_chat({"messages": HI, "thinking": thinking})
    assert err.value.status == 400 and err.value.param == "thinking"


def test_responses_effort_becomes_reasoning_effort_and_an_unknown_one_is_refused():
    assert responses.to_chat({"input": "Hi", "reasoning": {"effort": "minimal", "summary": "auto"}})[
        "reasoning_effort"] == "minimal"
    assert "reasoning_effort" not in responses.to_chat({"input": "Hi", "reasoning": {"summary": "auto"}})
    with pytest.raises(ApiError, match="'reasoning.effort' must be one of none, minimal, low, medium, high"):
        responses.to_chat({"input": "Hi", "reasoning": {"effort": "extreme"}})
    with pytest.raises(ApiError, match="'reasoning' must be an object"):
        responses.to_chat({"input": "Hi", "reasoning": "high"})


# -- history: earlier thoughts become the assistant turn's reasoning_content ----------------------


def test_earlier_thoughts_become_reasoning_content_in_every_api():
    ollama_chat = ollama.ChatAdapter({"model": "m", "messages": [
        *HI, {"role": "assistant", "content": "Hello", "thinking": "Greet back."}, {"role": "user", "content": "Bye"}]})
    assert ollama_chat.to_openai()["messages"][1] == {"role": "assistant", "content": "Hello",
                                                      "reasoning_content": "Greet back."}
    resp = responses.to_chat({"input": [
        {"role": "user", "content": "Hi?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Greet back."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
        {"role": "user", "content": "Look it up"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Look it up."}]},
        {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "found"},
        {"type": "reasoning", "id": "rs_3", "summary": [], "content": [{"type": "reasoning_text", "text": "Done?"}]},
    ]})
    assert resp["messages"][1] == {"role": "assistant", "content": "Hello", "reasoning_content": "Greet back."}
    assert resp["messages"][3]["reasoning_content"] == "Look it up." and resp["messages"][3]["tool_calls"]
    # A last thought that answers nothing yet is dropped: a template would read it as an answer to continue.
    assert [m["role"] for m in resp["messages"]] == ["user", "assistant", "user", "assistant", "tool"]
    # Thoughts between an answer's items belong to its one assistant turn, as chat writes it.
    merged = responses.to_chat({"input": [
        {"role": "user", "content": "Hi?"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "First."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Then."}]},
        {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"}]})["messages"]
    assert merged[1]["reasoning_content"] == "First.\nThen." and merged[1]["content"] == "Checking."
    ChatBody.model_validate({"messages": resp["messages"]})


# -- answers ----------------------------------------------------------------------------------------


def test_ollama_chat_answers_thinking_whole_and_in_lines_of_its_own():
    adapter = ollama.ChatAdapter({"model": "m", "messages": HI})
    whole = adapter.answer(completion("Let me see.", "Hello there"))
    assert whole["message"] == {"role": "assistant", "content": "Hello there", "thinking": "Let me see."}
    lines = [json.loads(line) for line in b"".join(feed(ollama.ChatAdapter({"model": "m"}), THOUGHTFUL)).splitlines()]
    assert [line["message"].get("thinking", "") for line in lines[:2]] == ["Let ", "me see."]
    assert all(line["message"]["content"] == "" for line in lines[:2])
    assert "".join(line["message"]["content"] for line in lines) == "Hello there" and lines[-1]["done"]


def test_ollama_generate_answers_thinking_beside_response():
    whole = ollama.GenerateAdapter({"model": "m", "prompt": "Hi?"}).answer(completion("Let me see.", "Hello there"))
    assert (whole["thinking"], whole["response"]) == ("Let me see.", "Hello there")
    lines = [json.loads(x) for x in b"".join(feed(ollama.GenerateAdapter({"model": "m"}), THOUGHTFUL)).splitlines()]
    assert "".join(x.get("thinking", "") for x in lines) == "Let me see."


def test_thoughts_a_runner_sends_although_thinking_was_turned_off_are_dropped():
    """A stock llama-server whose template has no switch still thinks: the client asked for none."""
    chat = ollama.ChatAdapter({"model": "m", "messages": HI, "think": False})
    assert "thinking" not in chat.answer(completion("Let me see.", "Hello there"))["message"]
    assert b"thinking" not in b"".join(feed(ollama.ChatAdapter({"model": "m", "think": False}), THOUGHTFUL))
    off = {"model": "m", "max_tokens": 8, "messages": HI, "thinking": {"type": "disabled"}}
    assert [b["type"] for b in anthropic.MessagesAdapter(off).answer(completion("x", "Hello"))["content"]] == ["text"]
    assert b"thinking" not in b"".join(feed(anthropic.MessagesAdapter(off), THOUGHTFUL))
    none = {"model": "m", "input": "Hi?", "reasoning": {"effort": "none"}}
    assert [i["type"] for i in responses.ResponsesAdapter(none).answer(completion("x", "Hello"))["output"]] == ["message"]
    assert b"reasoning_text" not in b"".join(feed(responses.ResponsesAdapter(none), THOUGHTFUL))


def test_anthropic_thinking_block_comes_first_with_an_empty_signature():
    message = anthropic.MessagesAdapter({"model": "m", "messages": HI}).answer(completion("Let me see.", "Hello there"))
    assert message["content"] == [{"type": "thinking", "thinking": "Let me see.", "signature": ""},
                                  {"type": "text", "text": "Hello there"}]


def test_anthropic_stream_opens_a_thinking_block_and_signs_it_empty_before_its_stop():
    evs = [ev.json() for ev in events(feed(anthropic.MessagesAdapter({"model": "m"}), THOUGHTFUL))]
    kinds = [(e["type"], (e.get("delta") or e.get("content_block") or {}).get("type")) for e in evs]
    assert kinds == [("message_start", None), ("content_block_start", "thinking"),
                     ("content_block_delta", "thinking_delta"), ("content_block_delta", "thinking_delta"),
                     ("content_block_delta", "signature_delta"), ("content_block_stop", None),
                     ("content_block_start", "text"), ("content_block_delta", "text_delta"),
                     ("content_block_delta", "text_delta"), ("content_block_stop", None),
                     ("message_delta", None), ("message_stop", None)]
    assert evs[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert [e["index"] for e in evs if "index" in e] == [0, 0, 0, 0, 0, 1, 1, 1, 1]


def test_a_stream_cut_mid_thought_closes_the_thought_and_leaks_nothing():
    cut = [chunk(reasoning_content="Hmm, let"), chunk("length", {"prompt_tokens": 5, "completion_tokens": 3,
                                                                 "completion_tokens_details": {"reasoning_tokens": 3}})]
    evs = [ev.json() for ev in events(feed(anthropic.MessagesAdapter({"model": "m"}), cut))]
    assert [e["type"] for e in evs][-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert evs[-2]["delta"]["stop_reason"] == "max_tokens" and not any(
        (e.get("delta") or {}).get("type") == "text_delta" for e in evs)
    rs = [ev.json() for ev in events(feed(responses.ResponsesAdapter({"model": "m", "input": "Hi?"}), cut))]
    done = rs[-1]["response"]
    assert rs[-1]["type"] == "response.completed" and [i["type"] for i in done["output"]] == ["reasoning"]
    assert done["output"][0]["content"] == [{"type": "reasoning_text", "text": "Hmm, let"}]
    assert done["usage"]["output_tokens_details"]["reasoning_tokens"] == 3


def test_responses_reasoning_item_and_its_stream_events():
    body = {"model": "m", "input": "Hi?", "reasoning": {"effort": "low"}}
    usage = {"prompt_tokens": 5, "completion_tokens": 9, "completion_tokens_details": {"reasoning_tokens": 4}}
    resp = responses.ResponsesAdapter(body).answer(completion("Let me see.", "Hello there", usage))
    item = resp["output"][0]
    assert item["type"] == "reasoning" and item["id"].startswith("rs_") and item["summary"] == []
    assert item["content"] == [{"type": "reasoning_text", "text": "Let me see."}] and item["encrypted_content"] is None
    assert resp["usage"]["output_tokens_details"] == {"reasoning_tokens": 4}
    assert resp["reasoning"] == {"effort": "low", "summary": None}
    evs = [ev.json() for ev in events(feed(responses.ResponsesAdapter(body), THOUGHTFUL))]
    kinds = [e["type"] for e in evs]
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta"]
    assert kinds[6:9] == ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    deltas = [e for e in evs if e["type"] == "response.reasoning_text.delta"]
    assert {(e["output_index"], e["content_index"], e["item_id"]) for e in deltas} == {(0, 0, evs[2]["item"]["id"])}
    assert evs[6]["text"] == "Let me see." and evs[8]["item"] == {**evs[8]["item"], "status": "completed"}
    texts = [e for e in evs if e["type"] == "response.output_text.delta"]
    assert {e["output_index"] for e in texts} == {1}
    assert [i["type"] for i in evs[-1]["response"]["output"]] == ["reasoning", "message"]


# -- the class default's vocabulary -----------------------------------------------------------------


def test_a_request_that_decides_thinking_keeps_its_own_fields():
    assert not says_thinking({"messages": HI, "chat_template_kwargs": {"other": 1}})
    for own in ({"chat_template_kwargs": {"enable_thinking": True}}, {"reasoning_effort": "low"},
                {"reasoning_budget_tokens": 0}, {"thinking_budget_tokens": 100}):
        assert says_thinking({"messages": HI, **own})
    merged = with_thinking({"chat_template_kwargs": {"other": 1}}, class_thinking("off"))
    assert merged == {"chat_template_kwargs": {"enable_thinking": False, "other": 1}, "reasoning_effort": "none"}
    assert with_thinking({}, class_thinking("on")) == {"chat_template_kwargs": {"enable_thinking": True}}
    assert class_thinking("model") == {}


# -- a stock llama-server's stream: the usage in a chunk of its own after the finish -----------------

LLAMA_SERVER = [chunk(role="assistant", content=None), chunk(reasoning_content="Let me see."),
                chunk(content="Hello there"), chunk("stop"),
                {"object": "chat.completion.chunk", "choices": [],
                 "usage": {"prompt_tokens": 5, "completion_tokens": 9,
                           "completion_tokens_details": {"reasoning_tokens": 4}}}]


def test_streams_ask_for_the_usage_and_wait_for_it_after_the_finish():
    msgs = anthropic.MessagesAdapter({"model": "m", "max_tokens": 8, "messages": HI, "stream": True})
    resp = responses.ResponsesAdapter({"model": "m", "input": "Hi?", "stream": True})
    for adapter in (msgs, resp):
        assert adapter.to_openai()["stream_options"] == {"include_usage": True}
    evs = [ev.json() for ev in events(feed(msgs, LLAMA_SERVER))]
    assert [e["type"] for e in evs][-2:] == ["message_delta", "message_stop"]
    assert evs[-2]["usage"]["output_tokens"] == 9 and evs[-2]["delta"]["stop_reason"] == "end_turn"
    rs = [ev.json() for ev in events(feed(resp, LLAMA_SERVER))]
    assert [e["type"] for e in rs].count("response.completed") == 1 and rs[-1]["type"] == "response.completed"
    assert rs[-1]["response"]["usage"]["output_tokens"] == 9
    assert rs[-1]["response"]["usage"]["output_tokens_details"] == {"reasoning_tokens": 4}


def test_a_finished_stream_without_any_usage_still_completes():
    finished = LLAMA_SERVER[:-1]
    evs = [ev.json() for ev in events(feed(anthropic.MessagesAdapter({"model": "m"}), finished))]
    assert [e["type"] for e in evs][-2:] == ["message_delta", "message_stop"] and evs[-2]["usage"]["output_tokens"] == 0
    rs = [ev.json() for ev in events(feed(responses.ResponsesAdapter({"model": "m", "input": "Hi?"}), finished))]
    assert rs[-1]["type"] == "response.completed" and rs[-1]["response"]["usage"]["output_tokens"] == 0
