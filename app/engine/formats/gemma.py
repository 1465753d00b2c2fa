"""Gemma 4: `<|channel>thought\\n...<channel|>` thoughts and `<|tool_call>call:NAME{key:value,...}<tool_call|>` calls.

Gemma 4 writes arguments in its own dict syntax: bare keys, strings between `<|"|>` quotes,
numbers, booleans, null, nested `{}` and `[]` as JSON has them. They are read into JSON here.
"""

from __future__ import annotations

import json
import re

from app.engine.formats.base import Call, Tools, make_call
from app.engine.formats.calls import CallSyntax, EndMarkerRegion

CALL_OPEN, CALL_CLOSE, QUOTE = "<|tool_call>call:", "<tool_call|>", '<|"|>'
THINK_START, THINK_END = "<|channel>thought", "<channel|>"
_NAME = re.compile(r"([A-Za-z0-9_\-.]+)(?=\{)")
_BARE = re.compile(r"[^\s{}\[\],:]+")


def gemma_value(text: str):
    """Gemma's dict syntax read as JSON; raises ValueError where it is not one."""
    out, pos = [], 0
    while pos < len(text):
        if text.startswith(QUOTE, pos):
            end = text.find(QUOTE, pos + len(QUOTE))
            if end == -1:
                raise ValueError("an unclosed <|\"|> string")
            out.append(json.dumps(text[pos + len(QUOTE): end], ensure_ascii=False))
            pos = end + len(QUOTE)
            continue
        c = text[pos]
        if c in "{}[],: \t\r\n":
            out.append(c)
            pos += 1
            continue
        m = _BARE.match(text, pos)
        word = m.group()
        after = text[m.end():].lstrip()
        # A key (before ':') is a name; a bare value must be JSON (a number, true, false, null).
        out.append(json.dumps(word) if after.startswith(":") else _bare_value(word))
        pos = m.end()
    return json.loads("".join(out))


def _bare_value(word: str) -> str:
    json.loads(word)  # raises ValueError unless a JSON scalar
    return word


def gemma_call(inner: str, tools: Tools) -> list[Call] | None:
    """`NAME{...}` (what `<|tool_call>call:` ... `<tool_call|>` holds)."""
    m = _NAME.match(inner)
    if m is None:
        return None
    try:
        args = gemma_value(inner[m.end():])
    except ValueError:
        return None
    call = make_call(tools, m.group(1), args)
    return [call] if call else None


def gemma4_syntax() -> CallSyntax:
    """Gemma 4's calls; empty thoughts and stray channel markers left in the content are dropped, as llama.cpp does."""
    return CallSyntax(markers=(CALL_OPEN,), dropped=(THINK_START + "\n" + THINK_END, "<|channel>", THINK_END),
                      open_region=lambda marker, tools: EndMarkerRegion(
                          len(marker), CALL_CLOSE, lambda inner: gemma_call(inner, tools), lenient=False),
                      call_name=lambda text: _name_of(text[len(CALL_OPEN):]))


def _name_of(inner: str) -> str | None:
    """A call's tool name once its arguments' "{" follows it."""
    m = _NAME.match(inner)
    return m.group(1) if m else None
