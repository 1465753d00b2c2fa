"""Tool-call formats: parsers on fixed model outputs (malformed ones included), the stream splitter, prompts."""

import json

import pytest

from app.engine import tools as T

TOOLS = [
    {"type": "function", "function": {"name": "HassTurnOn", "parameters": {
        "type": "object", "properties": {"name": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "GetLiveContext", "parameters": {"type": "object", "properties": {}}}},
]


def calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@pytest.mark.parametrize("fmt,text,expected,content", [
    (T.GENERIC, '{"tool_calls": [{"name": "HassTurnOn", "arguments": {"name": "Kitchen Light"}}]}',
     [("HassTurnOn", {"name": "Kitchen Light"})], ""),
    (T.GENERIC, '```json\n{"tool_calls": [{"name": "HassTurnOn", "arguments": {"name": "a"}}, '
                '{"name": "GetLiveContext", "arguments": {}}]}\n```',
     [("HassTurnOn", {"name": "a"}), ("GetLiveContext", {})], ""),
    (T.GENERIC, '{"tool_call": {"name": "GetLiveContext", "arguments": "{}"}}', [("GetLiveContext", {})], ""),
    (T.HERMES, 'Sure.\n<tool_call>\n{"name": "HassTurnOn", "arguments": {"name": "x"}}\n</tool_call>',
     [("HassTurnOn", {"name": "x"})], "Sure.\n"),
    (T.HERMES, '<tool_call>{"name": "HassTurnOn", "arguments": {}}</tool_call>\n<tool_call>{"name": '
               '"GetLiveContext", "arguments": {}}</tool_call>', [("HassTurnOn", {}), ("GetLiveContext", {})], "\n"),
    (T.HERMES, '<tool_call>\n{"name": "HassTurnOn", "arguments": {"name": "x"}}', [("HassTurnOn", {"name": "x"})], ""),
    (T.LLAMA3, '{"name": "HassTurnOn", "parameters": {"name": "x"}}', [("HassTurnOn", {"name": "x"})], ""),
    (T.LLAMA3, '<|python_tag|>{"name": "HassTurnOn", "parameters": {}}; {"name": "GetLiveContext", "parameters": {}}',
     [("HassTurnOn", {}), ("GetLiveContext", {})], ""),
    (T.MISTRAL, '[TOOL_CALLS][{"name": "HassTurnOn", "arguments": {"name": "x"}}]', [("HassTurnOn", {"name": "x"})], ""),
    (T.MISTRAL, '[{"name": "GetLiveContext", "arguments": {}}]', [("GetLiveContext", {})], ""),
    (T.MISTRAL, '[TOOL_CALLS]HassTurnOn[ARGS]{"name": "x"}', [("HassTurnOn", {"name": "x"})], ""),
])
def test_each_format_parses_its_calls(fmt, text, expected, content):
    parsed = T.parse(text, fmt, TOOLS)
    assert calls(parsed) == expected
    assert parsed.content == content
    assert all(c.id.startswith("call_") for c in parsed.calls)


@pytest.mark.parametrize("fmt,text", [
    (T.GENERIC, "The kitchen light is on."),
    (T.GENERIC, '{"tool_calls": [{"name": "HassTurnOn", "arguments": {"name": "x"'),  # cut off
    (T.GENERIC, '{"tool_calls": [{"name": "Unknown", "arguments": {}}]}'),  # not an offered tool
    (T.GENERIC, '{"tool_calls": [{"name": "HassTurnOn", "arguments": {}}, {"name": "Nope", "arguments": {}}]}'),
    (T.GENERIC, '{"tool_calls": [{"name": "HassTurnOn", "arguments": "not json"}]}'),
    (T.GENERIC, '{"response": "hello"}'),
    (T.LLAMA3, '{"name": "HassTurnOn", "parameters": [1, 2]}'),
    (T.MISTRAL, "[TOOL_CALLS][{\"name\": \"HassTurnOn\""),
    (T.MISTRAL, "[1, 2, 3]"),
])
def test_malformed_calls_come_back_as_content_whole(fmt, text):
    parsed = T.parse(text, fmt, TOOLS)
    assert parsed.calls == ()
    assert parsed.content == text


def test_a_broken_hermes_block_stays_text_while_a_whole_one_is_a_call():
    text = '<tool_call>{"name": "HassTurnOn", "arguments": {</tool_call><tool_call>{"name": "GetLiveContext", ' \
           '"arguments": {}}</tool_call>'
    parsed = T.parse(text, T.HERMES, TOOLS)
    assert calls(parsed) == [("GetLiveContext", {})]
    assert parsed.content == '<tool_call>{"name": "HassTurnOn", "arguments": {</tool_call>'


@pytest.mark.parametrize("fmt,pieces,streamed", [
    (T.GENERIC, ["The ", "light ", "is on."], "The light is on."),
    (T.GENERIC, [" ", '{"tool', '_calls": [{"name": "HassTurnOn", "arguments": {}}]}'], ""),
    (T.HERMES, ["Ok", " <tool", "_call>", '{"name": "GetLiveContext", "arguments": {}}', "</tool_call>"], "Ok "),
    (T.HERMES, ["a <", "b"], "a <b"),
])
def test_stream_sends_content_at_once_and_holds_a_call_region(fmt, pieces, streamed):
    stream = T.ToolStream(fmt, TOOLS)
    sent = "".join(stream.push(p) for p in pieces)
    end = stream.finish()
    assert sent + end.content == T.parse("".join(pieces), fmt, TOOLS).content
    assert sent == streamed or (sent + end.content) == streamed


def test_a_broken_streamed_call_ends_as_content_nothing_lost():
    stream = T.ToolStream(T.GENERIC, TOOLS)
    text = '{"tool_calls": [{"name": "HassTurnOn", "argu'
    assert stream.push(text) == ""
    end = stream.finish()
    assert end.calls == () and end.content == text


def test_format_detection_from_templates():
    assert T.detect_format(None) == T.GENERIC
    assert T.detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") == T.GENERIC
    assert T.detect_format("{% if tools %}<tool_call>{% endif %}") == T.HERMES
    assert T.detect_format("{% if tools %}[TOOL_CALLS]{% endif %}") == T.MISTRAL
    assert T.detect_format("{% if tools %}<|start_header_id|>ipython{% endif %}") == T.LLAMA3


def test_generic_history_alternates_turns_and_carries_the_calls():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Lamp on"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "HassTurnOn", "arguments": '{"name": "Lamp"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
        {"role": "user", "content": "Thanks"},
    ]
    out = T.prepare_messages(messages, T.GENERIC, TOOLS, "auto", True)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and "HassTurnOn{name?: string}" in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"tool_calls": [{"name": "HassTurnOn", "arguments": {"name": "Lamp"}}]}
    assert out[3]["content"] == "Result of HassTurnOn: done\n\nThanks"


def test_native_history_gets_arguments_as_objects():
    messages = [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "HassTurnOn", "arguments": '{"name": "x"}'}}]}]
    out = T.prepare_messages(messages, T.HERMES, TOOLS, "auto", True)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"name": "x"}


def test_grammars_per_choice():
    assert T.call_grammar(TOOLS, T.GENERIC, "none", True) is None
    auto = T.call_grammar(TOOLS, T.GENERIC, "auto", True)
    assert auto.lazy and auto.trigger_patterns
    required = T.call_grammar(TOOLS, T.HERMES, "required", False)
    assert not required.lazy and '"<tool_call>"' in required.gbnf
    named = T.call_grammar(TOOLS, T.GENERIC, {"type": "function", "function": {"name": "GetLiveContext"}}, True)
    assert "GetLiveContext" in named.gbnf and "HassTurnOn" not in named.gbnf
