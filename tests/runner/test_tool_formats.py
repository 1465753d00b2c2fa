"""Tool calls in a family's own format through the runner (C2): thinking before the call, name first, arguments
as deltas, several calls with their indices, a malformed call kept as content, whole and streamed alike."""

from __future__ import annotations

import json

import pytest

from tests.runner.streams import loads, payloads
from tests.runner.test_reasoning import QWEN3_LIKE, SPECIALS

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
REPLIES = {
    "Weather?": f"<think>\nThe user wants the weather.\n</think>\n\n{CALL_PARIS}",
    "Both?": f"<think>\nTwo calls.\n</think>\n\n{CALL_PARIS}\n{CALL_TIME}",
    "Broken?": '<think>\nHm.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',
    "Unknown?": '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',
}


@pytest.fixture
def qwen3(make_runner):
    return make_runner(replies=REPLIES, template=QWEN3_LIKE, specials=SPECIALS)


def both(c, question: str, **extra):
    """(whole choice, streamed events without [DONE]) of one question with both tools offered."""
    body = {"messages": [{"role": "user", "content": question}], "tools": [WEATHER, TIME], "temperature": 0, **extra}
    whole = loads(c.post("/v1/chat/completions", json=body))["choices"][0]
    events = payloads(c.post("/v1/chat/completions", json={**body, "stream": True}))
    assert events[-1] == "[DONE]"
    return whole, events[:-1]


def streamed_calls(events) -> list[dict]:
    """The streamed tool-call deltas put together by index, checking C2's shape on the way."""
    calls: dict[int, dict] = {}
    for ev in events:
        for d in (ev["choices"][0]["delta"].get("tool_calls") or []) if ev["choices"] else []:
            if d["index"] not in calls:
                # A call's first delta: its id, type and name, arguments empty.
                assert d["type"] == "function" and d["id"] and d["function"]["arguments"] == ""
                calls[d["index"]] = {"id": d["id"], "type": "function",
                                     "function": {"name": d["function"]["name"], "arguments": ""}}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


def text_of(events, key: str) -> str:
    """One delta field concatenated over the stream."""
    return "".join(ev["choices"][0]["delta"].get(key) or "" for ev in events if ev["choices"])


def test_a_call_after_a_thought_is_reasoning_then_the_call_whole_and_streamed(qwen3):
    whole, events = both(qwen3, "Weather?")
    message = whole["message"]
    assert whole["finish_reason"] == "tool_calls" and message["content"] is None
    assert message["reasoning_content"] == "The user wants the weather."
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    (streamed,) = streamed_calls(events)
    assert streamed["function"] == call["function"]
    assert text_of(events, "reasoning_content") == message["reasoning_content"]
    assert text_of(events, "content") == ""
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_several_calls_keep_their_indices(qwen3):
    whole, events = both(qwen3, "Both?")
    names = [c["function"]["name"] for c in whole["message"]["tool_calls"]]
    assert names == ["get_weather", "get_time"]
    streamed = streamed_calls(events)
    assert [c["function"] for c in streamed] == [c["function"] for c in whole["message"]["tool_calls"]]
    assert text_of(events, "content") == (whole["message"]["content"] or "")


@pytest.mark.parametrize("question", ["Broken?", "Unknown?"])
def test_a_malformed_or_unknown_call_is_content_never_half_a_call(qwen3, question):
    # A request's own grammar outranks the lazy call grammar: nothing then promises that a call which begins ends
    # whole, so no name goes out before its call is whole.
    whole, events = both(qwen3, question, grammar="root ::= .*")
    assert "tool_calls" not in whole["message"] and whole["finish_reason"] == "stop"
    assert "<tool_call>" in whole["message"]["content"]
    assert streamed_calls(events) == []
    assert text_of(events, "content") == whole["message"]["content"]
    assert text_of(events, "reasoning_content") == whole["message"].get("reasoning_content", "")


def test_under_the_call_grammar_a_name_goes_out_first_and_a_call_that_never_closes_is_no_content(qwen3):
    # The call grammar lets a model end a begun call only whole or cut; the fake model, which ignores grammars,
    # writes one that never closes: its name went out, so its text is not content, and no call is returned whole.
    whole, events = both(qwen3, "Broken?")
    assert "tool_calls" not in whole["message"]
    assert "<tool_call>" not in (whole["message"]["content"] or "")
    assert [c["function"] for c in streamed_calls(events)] == [{"name": "get_weather", "arguments": ""}]
    assert "<tool_call>" not in text_of(events, "content")
    _, events = both(qwen3, "Weather?")
    deltas = [d for ev in events if ev["choices"] for d in ev["choices"][0]["delta"].get("tool_calls") or []]
    assert [set(d["function"]) for d in deltas] == [{"name", "arguments"}, {"arguments"}]


def test_a_forced_call_keeps_its_thought(qwen3):
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "temperature": 0,
            "tool_choice": "required"}
    whole = loads(qwen3.post("/v1/chat/completions", json=body))["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["reasoning_content"] == "The user wants the weather."


# -- the runner's default grammar (llama-server's --grammar / --grammar-file) ---------------------------------

YES = 'root ::= "yes"'


def settings_grammar(c, **body) -> str:
    """The grammar llama-server's /completion reports it generated under."""
    out = loads(c.post("/completion", json={"prompt": "Q", "n_predict": 2, **body}))
    return out["generation_settings"]["grammar"]


def test_the_default_grammar_holds_where_a_request_brings_no_constraint(make_runner):
    c = make_runner(grammar=YES)
    assert settings_grammar(c) == YES
    assert settings_grammar(c, grammar='root ::= "no"') == 'root ::= "no"'
    assert settings_grammar(c, json_schema={"type": "integer"}) not in ("", YES)
    assert settings_grammar(make_runner()) == ""


def test_a_default_grammar_is_checked_when_the_runner_starts(tmp_path):
    from app.cli import build_parser
    from app.runner.command import _default_grammar

    path = tmp_path / "yes.gbnf"
    path.write_text(YES)
    args = build_parser().parse_args(["runner", "--grammar-file", str(path)])
    assert _default_grammar(args) == YES
    with pytest.raises(SystemExit, match="cannot read --grammar-file"):
        _default_grammar(build_parser().parse_args(["runner", "--grammar-file", str(tmp_path / "none.gbnf")]))
    with pytest.raises(SystemExit, match="not both"):
        _default_grammar(build_parser().parse_args(["runner", "--grammar", YES, "--grammar-file", str(path)]))


def test_a_chat_request_gets_the_default_grammar_unless_it_constrains_itself(make_runner):
    from app.protocols.openai import ChatBody
    from app.runner.job import chat_job

    state = make_runner(grammar=YES).application.state
    ask = {"messages": [{"role": "user", "content": "Q"}]}

    def grammar(**body):
        return chat_job(state, ChatBody.model_validate({**ask, **body}), {}).params.grammar

    assert grammar().gbnf == YES
    assert grammar(response_format={"type": "json_object"}).gbnf != YES
    # The runner's grammar outranks the lazy call grammar of tool_choice auto, not a call the request requires.
    assert grammar(tools=[WEATHER]).gbnf == YES
    assert grammar(tools=[WEATHER], tool_choice="required").gbnf != YES
    assert grammar(tools=[WEATHER], tool_choice="none").gbnf == YES
