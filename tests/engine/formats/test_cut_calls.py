"""Calls streamed one by one and a cut that keeps them (issue 53): every family with an array or several calls.

Each answer calls two tools; the text is pushed in small chunks, as a runner streams it, and cut by max_tokens inside
the second call. The first call must have gone out whole before the cut, the cut one must not come back as content,
and (with the call grammar in force) the second call's name must have gone out as soon as it was written.
"""

from __future__ import annotations

import json

import pytest

from app.engine.formats import AnswerParser, CallArguments, CallStart, Content
from app.engine.formats.detection import (
    COMMAND_R,
    DEEPSEEK_R1,
    DEEPSEEK_V3,
    FUNCTIONARY_V3_1,
    FUNCTIONARY_V3_2,
    GEMMA4,
    GENERIC,
    GRANITE,
    HERMES,
    KIMI_K2,
    LLAMA3,
    MAGISTRAL,
    MISTRAL,
    MISTRAL_LIST,
    QWEN3_CODER,
)
from tests.engine.formats.helpers import TOOLS

DS_R1 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```'
         '<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"city": "Tokyo"}\n```'
         '<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
# (format, an answer with two calls: get_weather(Paris) then get_time(Tokyo))
TWO_CALLS = [
    (GENERIC, '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "get_time", "arguments": {"city": "Tokyo"}}]}'),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"city": "Tokyo"}}\n</tool_call>'),
    (QWEN3_CODER, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                  "</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=city>\nTokyo\n</parameter>\n"
                  "</function>\n</tool_call>"),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"city": "Tokyo"}'),
    (MAGISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"city": "Tokyo"}'),
    (MISTRAL_LIST, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                   '{"name": "get_time", "arguments": {"city": "Tokyo"}}]'),
    (GRANITE, '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "get_time", "arguments": {"city": "Tokyo"}}]'),
    (COMMAND_R, '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": '
                '"Paris"}}, {"tool_call_id": "1", "tool_name": "get_time", "parameters": {"city": "Tokyo"}}]'
                '<|END_ACTION|>'),
    (DEEPSEEK_R1, DS_R1),
    (DEEPSEEK_V3, '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
                  '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"city": "Tokyo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    (KIMI_K2, '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
              '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
              '{"city": "Tokyo"}<|tool_call_end|><|tool_calls_section_end|>'),
    (FUNCTIONARY_V3_1, '<function=get_weather>{"city": "Paris"}</function><function=get_time>{"city": "Tokyo"}'
                       '</function>'),
    (FUNCTIONARY_V3_2, 'get_weather\n{"city": "Paris"}>>>get_time\n{"city": "Tokyo"}'),
    (GEMMA4, '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_call>call:get_time{city:<|"|>Tokyo'
             '<|"|>}<tool_call|>'),
]
IDS = [f"{fmt.name}-{i}" for i, (fmt, _) in enumerate(TWO_CALLS)]
PARIS = ("get_weather", {"city": "Paris"})


def _push(parser: AnswerParser, text: str, size: int = 3) -> list:
    pieces = []
    for i in range(0, len(text), size):
        pieces += parser.push(text[i:i + size])
    return pieces


@pytest.mark.parametrize("fmt, text", TWO_CALLS, ids=IDS)
@pytest.mark.parametrize("early", [False, True])
def test_the_first_call_goes_out_whole_before_the_second_and_a_cut_keeps_it(fmt, text, early):
    cut_at = text.index("Tokyo") + 2  # inside the second call's arguments, after its name
    parser = AnswerParser(fmt, TOOLS, early_names=early)
    before = _push(parser, text[:cut_at])
    args = [p for p in before if isinstance(p, CallArguments)]
    assert [(p.index, json.loads(p.text)) for p in args] == [(0, PARIS[1])], before
    starts = [(p.index, p.name) for p in before if isinstance(p, CallStart)]
    # Under the call grammar the cut call's name went out as soon as it was written.
    assert starts == ([(0, "get_weather"), (1, "get_time")] if early else [(0, "get_weather")])
    after = parser.finish(cut=True)
    answer = parser.answer
    assert [(c.name, json.loads(c.arguments)) for c in answer.calls] == [PARIS]
    assert answer.content == "" and not [p for p in before + after if isinstance(p, Content)]
    assert not [p for p in after if isinstance(p, CallArguments)]


@pytest.mark.parametrize("fmt, text", TWO_CALLS, ids=IDS)
def test_early_names_change_nothing_in_a_whole_answer(fmt, text):
    for early in (False, True):
        parser = AnswerParser(fmt, TOOLS, early_names=early)
        pieces = _push(parser, text, 2) + parser.finish()
        answer = parser.answer
        assert [c.name for c in answer.calls] == ["get_weather", "get_time"] and answer.content == ""
        streamed = {}
        for p in pieces:
            if isinstance(p, CallStart):
                streamed[p.index] = [p.id, p.name, ""]
            elif isinstance(p, CallArguments):
                streamed[p.index][2] += p.text
        assert [tuple(v) for _, v in sorted(streamed.items())] == [(c.id, c.name, c.arguments) for c in answer.calls]


def test_a_cut_before_any_tool_is_named_stays_content():
    text = '{"tool_calls": [{"na'
    parser = AnswerParser(GENERIC, TOOLS, early_names=True)
    parser.push(text)
    parser.finish(cut=True)
    assert parser.answer.content == text and not parser.answer.calls


def test_llama3_names_its_one_call_early():
    parser = AnswerParser(LLAMA3, TOOLS, early_names=True)
    pieces = parser.push('{"name": "get_weather", "parameters": {"ci')
    assert [(p.index, p.name) for p in pieces if isinstance(p, CallStart)] == [(0, "get_weather")]
