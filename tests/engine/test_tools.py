"""Tool calling's prompt side: the generic format's history and instructions, native histories.

The parsers', stream's, detection's and grammars' cases moved with them to tests/engine/test_tool_calls.py (C1).
"""

import json

from app.engine import tools as T

TOOLS = [
    {"type": "function", "function": {"name": "HassTurnOn", "parameters": {
        "type": "object", "properties": {"name": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "GetLiveContext", "parameters": {"type": "object", "properties": {}}}},
]


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


def test_native_history_reaches_the_template_as_sent():
    # Arguments become objects later, only for a template that reads them so (app.engine.template_inputs).
    messages = [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "HassTurnOn", "arguments": '{"name": "x"}'}}]}]
    out = T.prepare_messages(messages, T.HERMES, TOOLS, "auto", True)
    assert out == messages
