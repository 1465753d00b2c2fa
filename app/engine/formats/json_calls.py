"""Families whose calls are JSON: Hearth's generic envelope, Hermes/Qwen `<tool_call>`, Llama 3.x,
Mistral `[TOOL_CALLS]`, Granite `<|tool_call|>`, Command-R actions, Functionary, DeepSeek."""

from __future__ import annotations

import ast
import json
import re

from app.engine.formats.base import Call, Tools, make_call
from app.engine.formats.calls import CallSyntax, EndMarkerRegion, JsonRegion, ToEndRegion

_SPACE = " \t\n\r\v\f"  # what C's isspace calls whitespace, as llama.cpp trims


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


# -- Llama 3.x --------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"
_BUILTIN_CALL = re.compile(r"\s*([A-Za-z_][\w.]*)\.call\((.*)\)\s*$", re.DOTALL)


def _builtin_call(text: str, tools: Tools) -> list[Call] | None:
    """`name.call(key="value", ...)` (Llama 3.1's built-in tools), keyword values as Python literals."""
    m = _BUILTIN_CALL.match(text)
    if m is None:
        return None
    try:
        node = ast.parse(f"f({m.group(2)})", mode="eval").body
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    except (SyntaxError, ValueError, TypeError):
        return None
    if node.args or None in args:
        return None
    call = make_call(tools, m.group(1), args)
    return [call] if call else None


def python_tag_calls(text: str, tools: Tools, args_key: str = "parameters") -> list[Call] | None:
    """What follows `<|python_tag|>`: a JSON call, a built-in `name.call(...)`, or code for the python tool."""
    stripped = text.strip()
    if stripped.startswith("{"):
        return calls_from_list([_loads(stripped)], tools, args_key)
    calls = _builtin_call(stripped, tools)
    if calls is None and stripped:
        for name in ("python", "ipython", "code_interpreter"):
            if name in tools:
                call = make_call(tools, name, {"code": stripped})
                return [call] if call else None
    return calls


def llama3_syntax() -> CallSyntax:
    """A bare `{"name": ..., "parameters": {...}}` answer, or `<|python_tag|>` and a call to the end."""
    return CallSyntax(markers=(PYTHON_TAG,),
                      open_region=lambda marker, tools: ToEndRegion(len(marker),
                                                                    lambda t: python_tag_calls(t, tools)),
                      anchored=bare_json_start,
                      open_anchored=lambda tools: JsonRegion(
                          bare_json_start, lambda _h, v: calls_from_list([v], tools, "parameters")))


# -- Mistral / Magistral / Devstral -----------------------------------------------------------

MISTRAL_MARK = "[TOOL_CALLS]"
_MISTRAL_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\]([A-Za-z0-9_\-]+))?")


def mistral_header(text: str) -> int:
    """Where the JSON after `[TOOL_CALLS]` starts: `[...]` (older), or `name[ARGS]` (`name[CALL_ID]id[ARGS]`)."""
    body = text[len(MISTRAL_MARK):]
    args_at = body.find("[ARGS]")
    if args_at >= 0:
        name = _MISTRAL_NAME.fullmatch(body[:args_at])
        return len(MISTRAL_MARK) + args_at + 6 if name else -2
    lead = body.lstrip(_SPACE)
    if lead.startswith("[") and not "[ARGS]".startswith(lead[:6]) and not "[CALL_ID]".startswith(lead[:9]):
        return len(text) - len(lead)
    if not lead or "[ARGS]".startswith(lead):
        return -1
    if "{" in body or "\n" in lead or len(body) > 200:
        return -2
    return -1


def mistral_calls(header: str, value, tools: Tools) -> list[Call] | None:
    """The calls after `[TOOL_CALLS]`: a JSON list of calls, or one named call's arguments."""
    if isinstance(value, list):
        return calls_from_list(value, tools)
    m = _MISTRAL_NAME.match(header[len(MISTRAL_MARK):])
    call = make_call(tools, m.group(1), value, m.group(2)) if m else None
    return [call] if call else None


def mistral_syntax() -> CallSyntax:
    """`[TOOL_CALLS]name[ARGS]{...}` repeated (Mistral Small 3.x, Devstral, Magistral), or `[TOOL_CALLS][{...}]`."""
    return CallSyntax(markers=(MISTRAL_MARK,),
                      open_region=lambda marker, tools: JsonRegion(mistral_header,
                                                                   lambda h, v: mistral_calls(h, v, tools)))


# -- Granite ----------------------------------------------------------------------------------

GRANITE_MARK = "<|tool_call|>"


def granite_header(text: str) -> int:
    """The JSON list right after `<|tool_call|>`."""
    lead = text[len(GRANITE_MARK):].lstrip(_SPACE)
    if not lead:
        return -1
    return len(text) - len(lead) if lead.startswith("[") else -2


def granite_syntax() -> CallSyntax:
    """`<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`; `<response>` wrappers dropped."""
    return CallSyntax(markers=(GRANITE_MARK,), dropped=("<response>", "</response>"),
                      open_region=lambda marker, tools: JsonRegion(granite_header,
                                                                   lambda _h, v: calls_from_list(v, tools)))


# -- Command-R7B ------------------------------------------------------------------------------

def command_r_calls(inner: str, tools: Tools) -> list[Call] | None:
    """`[{"tool_call_id": ..., "tool_name": ..., "parameters": {...}}]`, ids kept."""
    items = _loads(inner)
    if not isinstance(items, list) or not items:
        return None
    calls = [make_call(tools, i.get("tool_name"), i.get("parameters", {}), str(i.get("tool_call_id") or ""))
             if isinstance(i, dict) else None for i in items]
    return None if any(c is None for c in calls) else calls


def command_r_syntax() -> CallSyntax:
    """`<|START_ACTION|>[...]<|END_ACTION|>`; the response and text wrappers dropped."""
    return CallSyntax(markers=("<|START_ACTION|>",),
                      dropped=("<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TEXT|>", "<|END_TEXT|>"),
                      open_region=lambda marker, tools: EndMarkerRegion(
                          len(marker), "<|END_ACTION|>", lambda inner: command_r_calls(inner, tools)))


# -- DeepSeek R1 / V3.1 -----------------------------------------------------------------------

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_R1_BODY = re.compile(r"([^\n]+)\n```(?:json)?\s*\n(.*?)\s*```\s*$", re.DOTALL)


def deepseek_unit(unit: str, tools: Tools) -> Call | None:
    """One `<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`'s inside: R1's `function<｜tool▁sep｜>NAME\\n```json...```` or V3.1's `NAME<｜tool▁sep｜>{...}`."""
    head, sep, body = unit.partition(DS_SEP)
    if not sep:
        return None
    m = _R1_BODY.match(body) if head.strip() in ("function", "") else None
    if m:
        return make_call(tools, m.group(1).strip(), m.group(2))
    return make_call(tools, head.strip(), body.strip())


def deepseek_calls(inner: str, tools: Tools) -> list[Call] | None:
    """The calls between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`: units, whitespace between them."""
    calls, pos = [], 0
    while True:
        begin = inner.find(DS_CALL_BEGIN, pos)
        if begin == -1:
            break
        if inner[pos:begin].strip():
            return None
        end = inner.find(DS_CALL_END, begin)
        if end == -1:
            return None
        call = deepseek_unit(inner[begin + len(DS_CALL_BEGIN): end], tools)
        if call is None:
            return None
        calls.append(call)
        pos = end + len(DS_CALL_END)
    return calls if calls and not inner[pos:].strip() else None


def deepseek_syntax() -> CallSyntax:
    """DeepSeek's calls section (or a lone call unit), R1 and V3.1 bodies alike."""
    def region(marker: str, tools: Tools):
        if marker == DS_CALLS_BEGIN:
            return EndMarkerRegion(len(marker), DS_CALLS_END, lambda inner: deepseek_calls(inner, tools))
        return EndMarkerRegion(0, DS_CALL_END, lambda inner: deepseek_calls(inner + DS_CALL_END, tools),
                               lenient=False)
    return CallSyntax(markers=(DS_CALLS_BEGIN, DS_CALL_BEGIN), open_region=region)


# -- Functionary ------------------------------------------------------------------------------

_FUNCTION_HEAD = re.compile(r"([A-Za-z0-9_.\-]+)>")


def functionary_v3_1_call(inner: str, tools: Tools) -> list[Call] | None:
    """`NAME>{json}` (what `<function=` ... `</function>` holds)."""
    m = _FUNCTION_HEAD.match(inner)
    call = make_call(tools, m.group(1), inner[m.end():].strip()) if m and inner[m.end():].strip() else None
    return [call] if call else None


def functionary_v3_1_syntax() -> CallSyntax:
    """`<function=NAME>{...}</function>`, and `<|python_tag|>` code for the python tool."""
    def region(marker: str, tools: Tools):
        if marker == PYTHON_TAG:
            return ToEndRegion(len(marker), lambda t: python_tag_calls(t, tools, "arguments"))
        return EndMarkerRegion(len(marker), "</function>", lambda inner: functionary_v3_1_call(inner, tools))
    return CallSyntax(markers=("<function=", PYTHON_TAG), open_region=region)


# -- Kimi K2 ----------------------------------------------------------------------------------

KIMI_SECTION_BEGIN, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_ARGS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_KIMI_ID = re.compile(r"\s*((?:functions\.)?([A-Za-z0-9_\-.]+?)(?::\d+)?)\s*")


def kimi_calls(inner: str, tools: Tools) -> list[Call] | None:
    """`<|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>` units; ids kept."""
    calls, pos = [], 0
    while True:
        begin = inner.find(KIMI_CALL_BEGIN, pos)
        if begin == -1:
            break
        end = inner.find(KIMI_CALL_END, begin)
        if inner[pos:begin].strip() or end == -1:
            return None
        head, sep, body = inner[begin + len(KIMI_CALL_BEGIN): end].partition(KIMI_ARGS)
        m = _KIMI_ID.fullmatch(head)
        call = make_call(tools, m.group(2), body.strip(), m.group(1)) if m and sep else None
        if call is None:
            return None
        calls.append(call)
        pos = end + len(KIMI_CALL_END)
    return calls if calls and not inner[pos:].strip() else None


def kimi_syntax() -> CallSyntax:
    """Kimi K2's calls section; each call's id is its own `functions.NAME:INDEX`."""
    return CallSyntax(markers=(KIMI_SECTION_BEGIN,), open_region=lambda marker, tools: EndMarkerRegion(
        len(marker), KIMI_SECTION_END, lambda inner: kimi_calls(inner, tools)))
