"""Whole versus streamed parsing: the same answer, every way of cutting it into chunks."""

from __future__ import annotations

import random

from app.engine.formats import Answer, AnswerParser, CallArguments, CallStart, Content, Reasoning

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
PYTHON = {"type": "function", "function": {"name": "python", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
TOOLS = [WEATHER, TIME, PYTHON]


def run(fmt, text: str, chunks: list[str] | None = None, tools=TOOLS, **options) -> tuple[Answer, list]:
    """The answer and the pieces, text pushed in the given chunks (one push when None)."""
    parser = AnswerParser(fmt, tools, **options)
    pieces = []
    for chunk in chunks if chunks is not None else [text]:
        pieces += parser.push(chunk)
    pieces += parser.finish()
    return parser.answer, pieces


def from_pieces(pieces: list) -> tuple[str, str, list[tuple[str, str, str]]]:
    """The fields the pieces spell: reasoning, content and (id, name, arguments) per call, in index order."""
    reasoning = "".join(p.text for p in pieces if type(p) is Reasoning)
    content = "".join(p.text for p in pieces if type(p) is Content)
    calls: dict[int, list[str]] = {}
    for p in pieces:
        if type(p) is CallStart:
            assert p.index == len(calls) and p.index not in calls, "indices count up from 0, a call starts once"
            calls[p.index] = [p.id, p.name, ""]
        elif type(p) is CallArguments:
            assert p.index in calls, "arguments come after their call's start"
            calls[p.index][2] += p.text
    return reasoning, content, [tuple(c) for c in calls.values()]


def fields(answer: Answer) -> tuple[str, str, list[tuple[str, str]]]:
    """An answer's fields without the call ids (fresh per parse)."""
    return answer.reasoning, answer.content, [(c.name, c.arguments) for c in answer.calls]


def chunkings(text: str, seed: int = 0, count: int = 6):
    """Ways of cutting text: one char at a time, and random chunk sizes."""
    yield list(text)
    rng = random.Random(seed)
    for _ in range(count):
        out, i = [], 0
        while i < len(text):
            n = rng.randint(1, 9)
            out.append(text[i:i + n])
            i += n
        yield out


def check(fmt, text: str, tools=TOOLS, **options) -> Answer:
    """The whole answer, after checking that every chunking gives the same fields and pieces that spell them."""
    whole, pieces = run(fmt, text, tools=tools, **options)
    reasoning, content, calls = from_pieces(pieces)
    assert (reasoning, content) == (whole.reasoning, whole.content)
    assert calls == [(c.id, c.name, c.arguments) for c in whole.calls]
    for chunks in chunkings(text):
        answer, pieces = run(fmt, text, chunks, tools=tools, **options)
        assert fields(answer) == fields(whole), chunks
        reasoning, content, calls = from_pieces(pieces)
        assert (reasoning, content) == (answer.reasoning, answer.content)
        assert calls == [(c.id, c.name, c.arguments) for c in answer.calls]
    return whole


def calls_of(answer: Answer) -> list[tuple[str, dict]]:
    """(name, arguments object) per call."""
    import json
    return [(c.name, json.loads(c.arguments)) for c in answer.calls]
