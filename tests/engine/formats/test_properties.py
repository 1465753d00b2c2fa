"""Properties over generated answers, for every family: any text, cut anywhere, parses the same as whole;
the pieces spell the answer exactly; every call names an offered tool with a JSON object of arguments."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.engine.formats import AnswerParser, Content, bench
from app.engine.formats.detection import FORMATS, GENERIC_THINKING, QWEN3, QWEN3_CODER_THINKING
from tests.engine.formats.helpers import TOOLS, fields, from_pieces, run

ALL = [*FORMATS.values(), QWEN3, QWEN3_CODER_THINKING, GENERIC_THINKING]
NAMES = {t["function"]["name"] for t in TOOLS}

# Fragments the answers are made of: every family's markup, call bodies, prose, whitespace.
MARKUP = sorted({m for f in ALL for m in (f.think_start, f.think_end, *f.preserved) if m} | {
    "<function=get_weather>", "</function>", "<parameter=city>", "</parameter>", ">>>", "all\n", "get_weather",
    "[ARGS]", '{"city": "Paris"}', '{"name": "get_time", "arguments": {}}', "```json\n", "```", "{", "}", "[", "]",
    '"', "\\", " to=functions.get_time", "<|channel|>final<|message|>", "<|channel|>analysis<|message|>",
    "<response>", "</response>", "<", "|", "\n", "  ", "Hello, world! "})
FRAGMENT = st.one_of(st.sampled_from(MARKUP), st.text(max_size=4), st.sampled_from(list(bench.CALLS.values())))
ANSWER = st.lists(FRAGMENT, max_size=14).map("".join)


def _cut(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(ALL), text=ANSWER, cuts=st.lists(st.integers(0, 10_000), max_size=12),
       in_thought=st.booleans(), split=st.booleans())
def test_any_answer_cut_anywhere_parses_as_the_whole(fmt, text, cuts, in_thought, split):
    options = {"in_thought": in_thought, "split_reasoning": split}
    whole, whole_pieces = run(fmt, text, **options)
    streamed, pieces = run(fmt, text, _cut(text, cuts), **options)
    assert fields(streamed) == fields(whole)
    reasoning, content, calls = from_pieces(pieces)
    assert (reasoning, content) == (streamed.reasoning, streamed.content)
    assert calls == [(c.id, c.name, c.arguments) for c in streamed.calls]
    for call in whole.calls:
        assert call.name in NAMES and isinstance(json.loads(call.arguments), dict)
    if not split:
        assert whole.reasoning == ""


@settings(max_examples=100, deadline=None)
@given(fmt=st.sampled_from(ALL), text=ANSWER)
def test_without_tools_there_are_no_calls(fmt, text):
    answer, _ = run(fmt, text, tools=None)
    assert answer.calls == ()


@settings(max_examples=100, deadline=None)
@given(fmt=st.sampled_from([f for f in ALL if f.reasoning and f.name != "gpt_oss"]), thought=st.text(max_size=30),
       cut=st.integers(0, 40))
def test_a_thought_cut_anywhere_never_reaches_content(fmt, thought, cut):
    text = (fmt.think_start + thought)[: len(fmt.think_start) + cut]
    if fmt.think_end in thought or fmt.think_end[:1] in thought or len(text) <= len(fmt.think_start):
        return
    answer, _ = run(fmt, text)
    assert answer.content == "" and answer.reasoning == answer.reasoning.strip(" \t\n\r\v\f")


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f"{f.name}{'-thinking' if f.reasoning else ''}")
def test_plain_content_streams_as_it_comes(fmt):
    """Nothing is held back but what could still begin a marker: a plain sentence is out before finish."""
    text = "The weather in Paris is mild today, with some rain later."
    chunks = [text[i:i + 3] for i in range(0, len(text), 3)]
    if fmt.name == "functionary_v3_2":
        chunks.insert(0, "all\n")  # its answer names its recipient first
    parser = AnswerParser(fmt, TOOLS)
    streamed = "".join(p.text for chunk in chunks for p in parser.push(chunk) if type(p) is Content)
    assert streamed == text
