"""A cut inside the second tool call through each API's adapter (issue 53): the first call is delivered as soon as it
is whole, the cut one never as a usable call, and the answer says it was cut (Ollama's done_reason "length",
Anthropic's stop_reason "max_tokens", an incomplete Responses item)."""

from __future__ import annotations

import json

from app.protocols.anthropic import MessagesAdapter
from app.protocols.ollama import ChatAdapter
from app.protocols.responses import ResponsesAdapter
from app.protocols.sse import events

START = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}]}
FIRST_NAME = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                                                   "function": {"name": "HassTurnOn", "arguments": ""}}]},
                           "finish_reason": None}]}
FIRST_ARGS = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {
    "arguments": '{"area": "kitchen"}'}}]}, "finish_reason": None}]}
SECOND_NAME = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                                                    "function": {"name": "HassTurnOff", "arguments": ""}}]},
                            "finish_reason": None}]}
CUT = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
       "usage": {"prompt_tokens": 50, "completion_tokens": 96}}
WHOLE = {"model": "m", "created": 1, "usage": {"prompt_tokens": 50, "completion_tokens": 96},
         "choices": [{"index": 0, "finish_reason": "length", "message": {
             "role": "assistant", "content": None, "tool_calls": [{"id": "call_a", "type": "function", "function": {
                 "name": "HassTurnOn", "arguments": '{"area": "kitchen"}'}}]}}]}


def test_ollama_streams_each_call_once_whole_and_leaves_out_the_cut_one():
    a = ChatAdapter({"model": "m", "messages": [{"role": "user", "content": "on"}]})
    before = [json.loads(line) for c in (START, FIRST_NAME, FIRST_ARGS) for line in a.feed(c)]
    # The first call went out before the stream ended, not gathered until its end.
    assert [m["message"]["tool_calls"] for m in before if m["message"].get("tool_calls")] == [
        [{"function": {"name": "HassTurnOn", "arguments": {"area": "kitchen"}}}]]
    rest = [json.loads(line) for c in (SECOND_NAME, CUT) for line in a.feed(c)] + [json.loads(x) for x in a.end()]
    assert not any(m.get("message", {}).get("tool_calls") for m in rest) and "error" not in rest[-1]
    assert rest[-1]["done"] and rest[-1]["done_reason"] == "length"
    whole = ChatAdapter({"model": "m"}).answer(WHOLE)
    assert whole["message"]["tool_calls"][0]["function"]["name"] == "HassTurnOn" and whole["done_reason"] == "length"


def test_ollama_leaves_out_a_relayed_servers_cut_call_in_a_whole_answer():
    # A stock llama-server returns the call it was cut inside, its arguments unfinished.
    relayed = json.loads(json.dumps(WHOLE))
    relayed["choices"][0]["message"]["tool_calls"].append(
        {"id": "call_b", "type": "function", "function": {"name": "HassTurnOff", "arguments": '{"area": "ki'}})
    whole = ChatAdapter({"model": "m"}).answer(relayed)
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["HassTurnOn"]


def test_anthropic_keeps_the_first_tool_use_and_stops_for_max_tokens():
    a = MessagesAdapter({"model": "m"}, input_tokens=50)
    evs = [e.json() for e in events(a.start() + [p for c in (START, FIRST_NAME, FIRST_ARGS, SECOND_NAME, CUT)
                                                  for p in a.feed(c)] + a.end())]
    starts = [e["content_block"] for e in evs if e["type"] == "content_block_start"]
    assert [b["name"] for b in starts] == ["HassTurnOn", "HassTurnOff"]
    inputs = [e["delta"]["partial_json"] for e in evs if e["type"] == "content_block_delta" and e["index"] == 0]
    assert json.loads("".join(inputs)) == {"area": "kitchen"}
    assert next(e for e in evs if e["type"] == "message_delta")["delta"]["stop_reason"] == "max_tokens"
    message = a.answer(WHOLE)
    assert [b["name"] for b in message["content"]] == ["HassTurnOn"] and message["stop_reason"] == "max_tokens"


def test_responses_marks_the_cut_call_incomplete_and_keeps_the_first():
    a = ResponsesAdapter({"input": "on"})
    evs = [e.json() for e in events(a.start() + [p for c in (START, FIRST_NAME, FIRST_ARGS, SECOND_NAME, CUT)
                                                  for p in a.feed(c)] + a.end())]
    done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    assert [(i["name"], i["status"]) for i in done] == [("HassTurnOn", "completed"), ("HassTurnOff", "incomplete")]
    assert json.loads(done[0]["arguments"]) == {"area": "kitchen"}
    whole = a.answer(WHOLE)
    assert [(i["name"], i["arguments"]) for i in whole["output"]] == [("HassTurnOn", '{"area": "kitchen"}')]
