"""The cases the older tool-call parser (app/engine/tools.py) was tested on, now through C1's answer formats.

Where C1 follows llama.cpp and the older parser did not, the case says so: Hermes content before a call is
trimmed; Mistral calls need their [TOOL_CALLS] marker; after Llama 3's <|python_tag|> comes code, not a JSON list.
"""

import json

import pytest

from app.engine.formats import AnswerParser, parse_answer
from app.engine.formats.detection import GENERIC, HERMES, LLAMA3, MISTRAL, detect
from app.engine.formats.grammars import call_grammar

TOOLS = [
    {"type": "function", "function": {"name": "HassTurnOn", "parameters": {
        "type": "object", "properties": {"name": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "GetLiveContext", "parameters": {"type": "object", "properties": {}}}},
]


def calls(answer):
    return [(c.name, json.loads(c.arguments)) for c in answer.calls]


@pytest.mark.parametrize("fmt,text,expected,content", [
    (GENERIC, '{"tool_calls": [{"name": "HassTurnOn", "arguments": {"name": "Kitchen Light"}}]}',
     [("HassTurnOn", {"name": "Kitchen Light"})], ""),
    (GENERIC, '```json\n{"tool_calls": [{"name": "HassTurnOn", "arguments": {"name": "a"}}, '
              '{"name": "GetLiveContext", "arguments": {}}]}\n```',
     [("HassTurnOn", {"name": "a"}), ("GetLiveContext", {})], ""),
    (GENERIC, '{"tool_call": {"name": "GetLiveContext", "arguments": "{}"}}', [("GetLiveContext", {})], ""),
    (HERMES, 'Sure.\n<tool_call>\n{"name": "HassTurnOn", "arguments": {"name": "x"}}\n</tool_call>',
     [("HassTurnOn", {"name": "x"})], "Sure."),
    (HERMES, '<tool_call>{"name": "HassTurnOn", "arguments": {}}</tool_call>\n<tool_call>{"name": '
             '"GetLiveContext", "arguments": {}}</tool_call>', [("HassTurnOn", {}), ("GetLiveContext", {})], ""),
    (HERMES, '<tool_call>\n{"name": "HassTurnOn", "arguments": {"name": "x"}}', [("HassTurnOn", {"name": "x"})], ""),
    (LLAMA3, '{"name": "HassTurnOn", "parameters": {"name": "x"}}', [("HassTurnOn", {"name": "x"})], ""),
    (MISTRAL, '[TOOL_CALLS][{"name": "HassTurnOn", "arguments": {"name": "x"}}]', [("HassTurnOn", {"name": "x"})], ""),
    (MISTRAL, '[TOOL_CALLS]HassTurnOn[ARGS]{"name": "x"}', [("HassTurnOn", {"name": "x"})], ""),
])
def test_each_format_parses_its_calls(fmt, text, expected, content):
    answer = parse_answer(fmt, TOOLS, text)
    assert calls(answer) == expected
    assert answer.content == content
    assert all(c.id for c in answer.calls)


@pytest.mark.parametrize("fmt,text", [
    (GENERIC, "The kitchen light is on."),
    (GENERIC, '{"tool_calls": [{"name": "HassTurnOn", "arguments": {"name": "x"'),  # cut off
    (GENERIC, '{"tool_calls": [{"name": "Unknown", "arguments": {}}]}'),  # not an offered tool
    (GENERIC, '{"tool_calls": [{"name": "HassTurnOn", "arguments": "not json"}]}'),
    (GENERIC, '{"response": "hello"}'),
    (LLAMA3, '{"name": "HassTurnOn", "parameters": [1, 2]}'),
    (MISTRAL, '[TOOL_CALLS][{"name": "HassTurnOn"'),
    (MISTRAL, "[1, 2, 3]"),
    (MISTRAL, '[{"name": "GetLiveContext", "arguments": {}}]'),  # no [TOOL_CALLS]: llama.cpp reads no call either
])
def test_malformed_calls_come_back_as_content_whole(fmt, text):
    answer = parse_answer(fmt, TOOLS, text)
    assert answer.calls == ()
    assert answer.content == text


def test_an_envelope_keeps_the_calls_before_a_malformed_one_which_is_text():
    # Each call of the array goes out as soon as its object closes, so one that breaks later cannot take it back;
    # the broken rest stays text, as a broken Hermes block does.
    text = '{"tool_calls": [{"name": "HassTurnOn", "arguments": {}}, {"name": "Nope", "arguments": {}}]}'
    answer = parse_answer(GENERIC, TOOLS, text)
    assert calls(answer) == [("HassTurnOn", {})]
    assert answer.content == '{"name": "Nope", "arguments": {}}]}'


def test_a_broken_hermes_block_stays_text_while_a_whole_one_is_a_call():
    text = '<tool_call>{"name": "HassTurnOn", "arguments": {</tool_call><tool_call>{"name": "GetLiveContext", ' \
           '"arguments": {}}</tool_call>'
    answer = parse_answer(HERMES, TOOLS, text)
    assert calls(answer) == [("GetLiveContext", {})]
    assert answer.content == '<tool_call>{"name": "HassTurnOn", "arguments": {</tool_call>'


@pytest.mark.parametrize("fmt,pieces,streamed", [
    (GENERIC, ["The ", "light ", "is on."], "The light is on."),
    (GENERIC, [" ", '{"tool', '_calls": [{"name": "HassTurnOn", "arguments": {}}]}'], ""),
    (HERMES, ["a <", "b"], "a <b"),
])
def test_a_stream_sends_content_and_holds_a_call_region(fmt, pieces, streamed):
    parser = AnswerParser(fmt, TOOLS)
    sent = [p for piece in pieces for p in parser.push(piece)] + parser.finish()
    assert "".join(getattr(p, "text", "") for p in sent if type(p).__name__ == "Content") == streamed
    assert parser.answer.content == streamed


def test_a_broken_streamed_call_ends_as_content_nothing_lost():
    parser = AnswerParser(GENERIC, TOOLS)
    text = '{"tool_calls": [{"name": "HassTurnOn", "argu'
    assert parser.push(text) == []
    parser.finish()
    assert parser.answer.calls == () and parser.answer.content == text


def test_format_detection_from_templates():
    assert detect(None).name == "generic"
    assert detect("{% for m in messages %}{{ m.content }}{% endfor %}").name == "generic"
    assert detect("{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert detect("{% if tools %}[TOOL_CALLS]{% endif %}").name == "mistral"
    assert detect("{% if tools %}<|start_header_id|>ipython{% endif %}").name == "llama3"


def test_grammars_per_choice():
    assert call_grammar(GENERIC, TOOLS, "none", True) is None
    auto = call_grammar(GENERIC, TOOLS, "auto", True)
    assert auto.lazy and auto.trigger_patterns
    required = call_grammar(HERMES, TOOLS, "required", False)
    assert not required.lazy and "<tool_call>" in required.gbnf
    named = call_grammar(GENERIC, TOOLS, {"type": "function", "function": {"name": "GetLiveContext"}}, True)
    assert "GetLiveContext" in named.gbnf and "HassTurnOn" not in named.gbnf
