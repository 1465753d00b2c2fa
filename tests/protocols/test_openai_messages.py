"""OpenAI's rule for chat messages: each has content, except an assistant message that calls tools."""

import json

import pytest

from app.protocols.openai import ApiError, ChatBody, parse_body

CALL = [{"id": "call_1", "type": "function", "function": {"name": "lights_on", "arguments": "{}"}}]


def parse(*messages: dict) -> ChatBody:
    """A chat body with these messages, parsed as the gateway and the runner parse it."""
    return parse_body(json.dumps({"messages": list(messages)}).encode(), ChatBody)[0]


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool"])
def test_a_message_without_content_is_a_clear_400(role):
    with pytest.raises(ApiError) as caught:
        parse({"role": "user", "content": "hi"}, {"role": role})
    err = caught.value
    assert err.status == 400 and err.param == "messages"
    assert err.message == f"'messages.1.content' is required in a {role} message"


def test_null_content_is_missing_content():
    with pytest.raises(ApiError, match=r"'messages.0.content' is required in a user message"):
        parse({"role": "user", "content": None})


def test_an_assistant_message_may_omit_content_only_when_it_calls_tools():
    body = parse({"role": "user", "content": "lights"}, {"role": "assistant", "tool_calls": CALL},
                 {"role": "tool", "tool_call_id": "call_1", "content": "done"})
    assert body.messages[1].content is None and body.messages[1].tool_calls
    assert parse({"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                                    "function_call": {"name": "f", "arguments": "{}"}})
    with pytest.raises(ApiError, match="only when it has tool_calls"):
        parse({"role": "user", "content": "x"}, {"role": "assistant"})


def test_empty_content_is_still_content():
    assert parse({"role": "user", "content": ""}).messages[0].content == ""


def test_two_assistant_messages_at_the_end_cannot_be_continued():
    with pytest.raises(ApiError, match="two assistant messages end the list") as caught:
        parse({"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
              {"role": "assistant", "content": "b"})
    assert caught.value.status == 400 and caught.value.param == "messages"
    # Not continued (a generation prompt after them): nothing to choose between.
    body = parse_body(json.dumps({"messages": [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
                                  "add_generation_prompt": False}).encode(), ChatBody)[0]
    assert len(body.messages) == 2
