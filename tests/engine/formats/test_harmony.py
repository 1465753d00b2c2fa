"""gpt-oss harmony: analysis thoughts, final content, commentary calls (cases after llama.cpp's test-chat.cpp)."""

import pytest

from app.engine.formats import starts_in_thought
from app.engine.formats.detection import GPT_OSS
from tests.engine.formats.helpers import calls_of, check

THOUGHTS = "<|channel|>analysis<|message|>I'm\nthinking<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Hello, world!\nWhat's up?"
PARIS = [("get_weather", {"city": "Paris"})]


def test_analysis_is_reasoning_and_final_is_content():
    answer = check(GPT_OSS, THOUGHTS + FINAL)
    assert (answer.reasoning, answer.content) == ("I'm\nthinking", "Hello, world!\nWhat's up?")


def test_reasoning_format_none_keeps_the_analysis_message_in_content():
    answer = check(GPT_OSS, THOUGHTS + FINAL, split_reasoning=False)
    assert answer.content == "<|channel|>analysis<|message|>I'm\nthinking<|end|>Hello, world!\nWhat's up?"


def test_a_cut_analysis_is_reasoning():
    answer = check(GPT_OSS, "<|channel|>analysis<|message|>I'm\nthink")
    assert (answer.reasoning, answer.content) == ("I'm\nthink", "")


@pytest.mark.parametrize("text", [
    ' to=functions.get_weather<|channel|>analysis<|message|>{"city": "Paris"}',
    '<|channel|>analysis to=functions.get_weather<|message|>{"city": "Paris"}',
    ' to=functions.get_weather<|channel|>analysis <|constrain|>json<|message|>{"city": "Paris"}',
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
])
def test_calls_with_the_recipient_in_either_header(text):
    answer = check(GPT_OSS, text)
    assert calls_of(answer) == PARIS and answer.content == "" and answer.reasoning == ""


def test_thinking_then_a_call_then_another():
    text = (THOUGHTS + '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Paris"}<|call|><|start|>assistant<|channel|>commentary to=functions.get_time '
            "<|constrain|>json<|message|>{}<|call|>")
    answer = check(GPT_OSS, text)
    assert answer.reasoning == "I'm\nthinking" and calls_of(answer) == PARIS + [("get_time", {})]


def test_a_call_to_an_unknown_tool_or_cut_is_content_and_builtin_recipients_are_dropped():
    bad = '<|channel|>commentary to=functions.nope <|constrain|>json<|message|>{}<|call|>'
    assert check(GPT_OSS, bad).content == bad
    cut = '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Par'
    assert check(GPT_OSS, cut).content == cut and not check(GPT_OSS, cut).calls
    answer = check(GPT_OSS, "<|channel|>analysis<|message|>I will run python<|end|>"
                            "<|start|>assistant to=container.exec<|channel|>commentary<|message|>ls")
    assert (answer.reasoning, answer.content, answer.calls) == ("I will run python", "", ())


def test_commentary_to_assistant_before_the_channel_is_ignored():
    answer = check(GPT_OSS, "<|channel|>commentary to=assistant" + THOUGHTS + FINAL)
    assert (answer.reasoning, answer.content) == ("I'm\nthinking", "Hello, world!\nWhat's up?")


def test_structured_final_and_plain_text():
    answer = check(GPT_OSS, THOUGHTS + '<|start|>assistant<|channel|>final <|constrain|>json<|message|>{"a": 1}')
    assert answer.content == '{"a": 1}'
    assert check(GPT_OSS, "Just text.").content == "Just text."


def test_a_thought_the_prompt_opened():
    assert starts_in_thought(GPT_OSS, "...<|start|>assistant<|channel|>analysis<|message|>")
    assert not starts_in_thought(GPT_OSS, "...<|start|>assistant")
    answer = check(GPT_OSS, "I'm thinking<|end|>" + FINAL, in_thought=True)
    assert (answer.reasoning, answer.content) == ("I'm thinking", "Hello, world!\nWhat's up?")
