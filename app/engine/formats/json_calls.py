"""Families whose calls are JSON: Hearth's generic envelope, Hermes/Qwen `<tool_call>`, Llama 3.x,
Mistral `[TOOL_CALLS]`, Granite `<|tool_call|>`, Command-R actions, Functionary, DeepSeek."""

from __future__ import annotations

import json
import re

from app.engine.formats.base import Call, Tools, make_call
from app.engine.formats.calls import CallSyntax, EndMarkerRegion, JsonRegion

_SPACE = " \t\r\n"


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def call_from_object(obj, tools: Tools, args_key: str = "arguments") -> Call | None:
    """A call from {"name", "arguments"} (or "parameters"; OpenAI's {"function": {...}} too) naming an offered tool."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict) and "name" not in obj:
        obj = obj["function"]
    if args_key in obj:
        args = obj[args_key]
    elif "arguments" in obj:
        args = obj["arguments"]
    elif "parameters" in obj:
        args = obj["parameters"]
    elif set(obj) <= {"name", "type", "id"}:
        args = {}
    else:
        return None
    return make_call(tools, obj.get("name"), args, obj.get("id"))


def calls_from_list(items, tools: Tools, args_key: str = "arguments") -> list[Call] | None:
    """All the calls of a JSON list, or None if any is not a valid call."""
    if not isinstance(items, list) or not items:
        return None
    calls = [call_from_object(i, tools, args_key) for i in items]
    return None if any(c is None for c in calls) else calls


# -- generic envelope and Llama 3.x bare JSON ----------------------------------------------------

_FENCE = re.compile(r"```(?:json)?[ \t]*\n?\s*")


def fenced_json_start(text: str) -> int:
    """Where a JSON object starts in text that begins with it or with a Markdown fence; -1 unknown, -2 no."""
    if text.startswith("{"):
        return 0
    if text.startswith("```"):
        m = _FENCE.match(text)
        if m.end() < len(text):
            if text[m.end()] == "{":
                return m.end()
            return -1 if m.end() == 3 and "json".startswith(text[3:]) else -2
        return -1
    return -1 if "```".startswith(text) else -2


def bare_json_start(text: str) -> int:
    """Where a bare JSON object starts (Llama 3.x): at once or never."""
    return 0 if text.startswith("{") else -2


_AFTER_FENCE = re.compile(r"\s*(?:```\s*)?")


def after_fence(text: str) -> int:
    """The whitespace and closing fence after a fenced call: how much to drop (-1 while it may grow)."""
    m = _AFTER_FENCE.match(text)
    rest = text[m.end():]
    if not rest or ("`" not in m.group() and "```".startswith(rest)):
        return -1
    return m.end()


def generic_calls(value, tools: Tools, args_key: str = "arguments") -> list[Call] | None:
    """The calls of the generic envelope {"tool_calls": [...]}, {"tool_call": {...}} or a bare call object."""
    if isinstance(value, dict) and "tool_calls" in value:
        return calls_from_list(value["tool_calls"], tools, args_key)
    if isinstance(value, dict) and "tool_call" in value:
        return calls_from_list([value["tool_call"]], tools, args_key)
    return calls_from_list([value], tools, args_key)


def generic_syntax() -> CallSyntax:
    """Hearth's generic envelope, the whole answer (after whitespace or a fence) one JSON object."""
    return CallSyntax(anchored=fenced_json_start,
                      open_anchored=lambda tools: JsonRegion(fenced_json_start,
                                                             lambda _h, v: generic_calls(v, tools)),
                      after_call=after_fence)


# -- Hermes / Qwen ----------------------------------------------------------------------------

def hermes_syntax() -> CallSyntax:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, anywhere."""
    def region(marker: str, tools: Tools):
        return EndMarkerRegion(len(marker), "</tool_call>",
                               lambda inner: calls_from_list([_loads(inner)], tools) if inner.strip() else None)
    return CallSyntax(markers=("<tool_call>",), open_region=region)
