"""The Anthropic and Responses adapters through app.protocols.adapter's interface (pure wire format, no HTTP)."""

from __future__ import annotations

import pytest

from app.protocols.anthropic import MessagesAdapter
from app.protocols.openai import ApiError
from app.protocols.responses import ResponsesAdapter
from app.protocols.sse import events

CHUNKS = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
     "usage": {"prompt_tokens": 5, "completion_tokens": 1}},
]
COMPLETION = {"model": "m", "created": 1, "choices": [{"index": 0, "finish_reason": "stop",
                                                       "message": {"role": "assistant", "content": "Hi"}}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 1}}


def names(pieces: list[bytes]) -> list[str]:
    return [ev.event for ev in events(pieces)]


@pytest.mark.parametrize("make", [lambda b: MessagesAdapter(b, input_tokens=5), ResponsesAdapter])
def test_the_request_becomes_a_chat_request_with_the_clients_model(make):
    body = {"model": "their-name", "messages": [{"role": "user", "content": "hi"}], "input": "hi", "max_tokens": 3}
    chat = make(body).to_openai()
    assert chat["model"] == "their-name" and chat["messages"][-1]["content"] == "hi"


def test_a_messages_stream_is_start_feed_end_and_a_cut_stream_ends_in_an_error_event():
    a = MessagesAdapter({"model": "m"}, input_tokens=5)
    pieces = a.start() + [p for c in CHUNKS for p in a.feed(c)] + a.end()
    assert names(pieces) == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                             "message_delta", "message_stop"]
    assert next(events(pieces)).json()["message"]["usage"]["input_tokens"] == 5
    cut = MessagesAdapter({"model": "m"})
    pieces = cut.start() + cut.feed(CHUNKS[1]) + cut.end()
    assert names(pieces)[-1] == "error" and cut.end() == []


def test_a_responses_stream_is_start_feed_end_and_a_cut_stream_fails():
    a = ResponsesAdapter({"input": "x"})
    pieces = a.start() + [p for c in CHUNKS for p in a.feed(c)] + a.end()
    assert names(pieces)[0] == "response.created" and names(pieces)[-1] == "response.completed"
    cut = ResponsesAdapter({"input": "x"})
    assert names(cut.start() + cut.feed(CHUNKS[1]) + cut.end())[-2:] == ["error", "response.failed"]


def test_whole_answers_and_errors_in_each_apis_shape():
    assert MessagesAdapter({}).answer(COMPLETION)["content"] == [{"type": "text", "text": "Hi"}]
    assert ResponsesAdapter({"input": "x"}).answer(COMPLETION)["output"][0]["content"][0]["text"] == "Hi"
    err = ApiError(429, "slow down")
    assert MessagesAdapter({}).error(err) == (429, {"type": "error", "error": {"type": "rate_limit_error",
                                                                               "message": "slow down"}})
    assert ResponsesAdapter({}).error(err) == (429, err.body())
    assert MessagesAdapter({}).stream_mimetype == ResponsesAdapter({}).stream_mimetype == "text/event-stream"
