"""The generic envelope (templates without tools) and Hermes/Qwen3 `<tool_call>` with `<think>` reasoning."""

import json

from app.engine.formats import GENERIC, Content, detect
from app.engine.formats.detection import HERMES, QWEN3
from tests.engine.formats.helpers import TOOLS, calls_of, check, run

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_the_generic_envelope_is_calls_and_what_follows_its_fence_is_dropped():
    answer = check(GENERIC, '```json\n{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},'
                            ' {"name": "get_time", "arguments": {}}]}\n```')
    assert calls_of(answer) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert answer.content == "" and answer.reasoning == ""


def test_generic_bare_call_and_single_tool_call_key():
    assert calls_of(check(GENERIC, "  " + CALL)) == [("get_weather", {"city": "Paris"})]
    assert calls_of(check(GENERIC, '{"tool_call": {"name": "get_time"}}')) == [("get_time", {})]


def test_generic_plain_text_and_json_that_is_no_call_stay_content():
    for text in ["Hello, world!", '{"answer": 42}', '{"tool_calls": [{"name": "nope", "arguments": {}}]}',
                 'Sure: {"name": "get_weather", "arguments": {}}', '{"tool_calls": [', "```python\nprint(1)\n```"]:
        answer = check(GENERIC, text)
        assert answer.content == text and not answer.calls, text


def test_generic_arguments_are_compact_and_deterministic():
    answer = check(GENERIC, '{"tool_calls":[{"name":"get_weather","arguments":"{\\"city\\":\\"Zürich\\"}"}]}')
    assert answer.calls[0].arguments == json.dumps({"city": "Zürich"}, ensure_ascii=False)
    assert answer.calls[0].id.startswith("call_") and len(answer.calls[0].id) == 29


def test_generic_without_tools_parses_nothing():
    text = '{"tool_calls": [{"name": "get_time", "arguments": {}}]}'
    answer, _ = run(GENERIC, text, tools=None)
    assert answer.content == text and not answer.calls


def test_hermes_calls_with_content_before_and_after():
    text = f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n" \
           '{"name": "get_time", "arguments": {}}\n</tool_call>\nDone.'
    answer = check(HERMES, text)
    assert calls_of(answer) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert answer.content == "Let me look.\nDone."


def test_a_malformed_or_unknown_hermes_call_is_content_whole():
    for inner in ['{"name": "nope", "arguments": {}}', '{"name": "get_weather", "arguments": [1]}', "not json",
                  '{"name": "get_weather", "arguments": {"city": "Paris"}} trailing']:
        text = f"<tool_call>{inner}</tool_call>"
        answer = check(HERMES, text)
        assert answer.content == text and not answer.calls, inner


def test_a_cut_hermes_call_is_content():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    answer = check(HERMES, text)
    assert answer.content == text and not answer.calls


def test_a_hermes_call_whose_close_is_missing_at_the_end_is_still_whole():
    assert calls_of(check(HERMES, f"<tool_call>\n{CALL}\n")) == [("get_weather", {"city": "Paris"})]


def test_a_call_is_emitted_only_whole_name_first():
    _, pieces = run(HERMES, f"<tool_call>\n{CALL}\n</tool_call>", list(f"<tool_call>\n{CALL}\n</tool_call>"))
    kinds = [type(p).__name__ for p in pieces]
    assert kinds == ["CallStart", "CallArguments"]


def test_qwen3_thought_is_trimmed_and_the_content_after_it_too():
    answer = check(QWEN3, "<think>\nI'm\nthinking\n</think>\n\nHello, world!\nWhat's up?")
    assert (answer.reasoning, answer.content) == ("I'm\nthinking", "Hello, world!\nWhat's up?")


def test_qwen3_with_the_thought_opened_by_the_prompt():
    answer = check(QWEN3, "I'm\nthinking\n</think>\n\nHello, world!", in_thought=True)
    assert (answer.reasoning, answer.content) == ("I'm\nthinking", "Hello, world!")


def test_reasoning_format_none_leaves_the_thought_in_content_verbatim():
    text = "I'm\nthinking\n</think>\n\nHello, world!"
    answer = check(QWEN3, text, in_thought=True, split_reasoning=False)
    assert (answer.reasoning, answer.content) == ("", "<think>\n" + text)
    text = "<think>I'm\nthinking</think>Hello"
    assert check(QWEN3, text, split_reasoning=False).content == text


def test_reasoning_format_none_keeps_the_whitespace_after_the_thought_before_a_call():
    answer = check(QWEN3, f"<think>I'm\nthinking</think>\n\n<tool_call>\n{CALL}\n</tool_call>", split_reasoning=False)
    assert answer.content == "<think>I'm\nthinking</think>\n\n" and calls_of(answer) == [("get_weather", {"city": "Paris"})]


def test_an_answer_cut_mid_thought_is_all_reasoning():
    answer = check(QWEN3, "<think>\nStill thinking about <tool_call> and")
    assert (answer.reasoning, answer.content, answer.calls) == ("Still thinking about <tool_call> and", "", ())
    answer = check(QWEN3, "Still </thi", in_thought=True)
    assert (answer.reasoning, answer.content) == ("Still </thi", "")


def test_thinking_then_a_call():
    answer = check(QWEN3, f"<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>")
    assert answer.reasoning == "The user wants weather." and answer.content == ""
    assert calls_of(answer) == [("get_weather", {"city": "Paris"})]


def test_a_call_ends_a_thought_the_prompt_opened():
    answer = check(QWEN3, f"Need the weather.\n<tool_call>\n{CALL}\n</tool_call>", in_thought=True)
    assert answer.reasoning == "Need the weather." and calls_of(answer) == [("get_weather", {"city": "Paris"})]


def test_a_think_marker_later_in_the_content_is_content():
    text = "Use <think> tags like </think> this."
    assert check(QWEN3, text).content == text


def test_content_pieces_are_never_held_past_a_possible_marker():
    _, pieces = run(HERMES, "Hello <tool", ["Hello ", "<tool"], tools=TOOLS)
    assert pieces[0] == Content("Hello")


def test_detect_on_the_real_templates(templates):
    assert detect(templates["Qwen-Qwen3-0.6B"]) == QWEN3
    assert detect(templates["Qwen-Qwen2.5-7B-Instruct"]) == HERMES
    assert detect(templates["NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use"]).name == "hermes"
    assert detect(templates["google-gemma-2-2b-it"]) == GENERIC
    assert detect(None) == GENERIC
