"""The shared vocabulary of answer formats: ChatFormat, the streamed pieces, calls and answers.

Every family's parser speaks these: it turns generated text into `Reasoning`, `Content`,
`CallStart` and `CallArguments` pieces whose texts concatenate to the `Answer`'s fields.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class ChatFormat:
    """How one model family writes its answers: thoughts, calls, the special tokens the parser must see."""

    name: str
    tools: bool = False  # the template takes `tools` natively
    reasoning: bool = False  # the model thinks before it answers
    think_start: str = ""
    think_end: str = ""
    # Special-token texts that must be rendered into the output text for the parser to see them.
    preserved: tuple[str, ...] = ()
    # The family wraps plain answers in markup too (Functionary v3.2's "all\n"): parsed even without tools.
    marked_content: bool = False


class Reasoning(NamedTuple):
    """Thought text."""

    text: str


class Content(NamedTuple):
    """Answer text for the user."""

    text: str


class CallStart(NamedTuple):
    """A whole, valid call begins: its index among the answer's calls, its id and the tool's name."""

    index: int
    id: str
    name: str


class CallArguments(NamedTuple):
    """Arguments text (part of a JSON object) of the call with this index."""

    index: int
    text: str


Piece = Reasoning | Content | CallStart | CallArguments


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments as a JSON object text."""

    name: str
    arguments: str
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict:
        """OpenAI's tool_calls[] entry."""
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


@dataclass(frozen=True)
class Answer:
    """A whole answer split into its thoughts, its content and its calls."""

    reasoning: str = ""
    content: str = ""
    calls: tuple[ToolCall, ...] = ()


def new_call_id() -> str:
    """A fresh OpenAI-style call id: "call_" and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def arguments_text(arguments: dict) -> str:
    """The one text of an arguments object: compact enough and deterministic, so streams and whole answers agree."""
    return json.dumps(arguments, ensure_ascii=False)


class Tools:
    """The offered tools, by name, with their parameter schemas."""

    __slots__ = ("schemas",)

    def __init__(self, tools: list[dict] | None):
        self.schemas: dict[str, dict] = {}
        for tool in tools or ():
            function = tool.get("function", tool) if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                self.schemas[function["name"]] = function.get("parameters") or {}

    def __bool__(self) -> bool:
        return bool(self.schemas)

    def __contains__(self, name: object) -> bool:
        return name in self.schemas


class Call(NamedTuple):
    """A validated call before it gets its index: name, arguments text, id."""

    name: str
    arguments: str
    id: str


def make_call(tools: Tools, name, arguments, call_id: str | None = None) -> Call | None:
    """The call if it names an offered tool and its arguments are a JSON object (or its text); else None."""
    if not isinstance(name, str) or name not in tools:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return Call(name, arguments_text(arguments), call_id if isinstance(call_id, str) and call_id else new_call_id())


def held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of text could begin one of the markers (held back until known)."""
    best = 0
    size = len(text)
    for marker in markers:
        first = marker[0]
        at = text.find(first, max(0, size - len(marker) + 1))
        while at != -1:
            if marker.startswith(text[at:]):
                best = max(best, size - at)
                break
            at = text.find(first, at + 1)
    return best


def first_marker(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """The earliest occurrence at or after start of any of the markers: (position, marker), or (-1, "")."""
    found, which = -1, ""
    for marker in markers:
        at = text.find(marker, start)
        if at != -1 and (found == -1 or at < found):
            found, which = at, marker
    return found, which


_OUTSIDE = re.compile(r'[{}\[\]"]')
_INSIDE = re.compile(r'["\\]')


class JsonEnd:
    """Finds, incrementally, where the JSON object or array at the start of a growing text ends.

    Only new characters are scanned on each call; the value is decoded once, when it is whole.
    """

    __slots__ = ("pos", "depth", "in_string")

    def __init__(self, start: int = 0):
        self.pos = start
        self.depth = 0
        self.in_string = False

    def scan(self, text: str) -> int:
        """The end (exclusive) of the value, -1 while it is not whole, -2 if the text opens no object or array."""
        if self.depth == 0 and not self.in_string:
            # Skip leading whitespace; the first character must open the value.
            while self.pos < len(text) and text[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos >= len(text):
                return -1
            if text[self.pos] not in "{[":
                return -2
        pos = self.pos
        while True:
            if self.in_string:
                m = _INSIDE.search(text, pos)
                if m is None:
                    self.pos = len(text)
                    return -1
                if m.group() == "\\":
                    if m.end() >= len(text):
                        self.pos = m.start()  # the escaped character is still to come
                        return -1
                    pos = m.end() + 1
                    continue
                self.in_string = False
                pos = m.end()
                continue
            m = _OUTSIDE.search(text, pos)
            if m is None:
                self.pos = len(text)
                return -1
            c = m.group()
            pos = m.end()
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    self.pos = pos
                    return pos
