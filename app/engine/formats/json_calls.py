"""Families whose calls are JSON: Hearth's generic envelope, Hermes/Qwen `<tool_call>`, Llama 3.x,
Mistral `[TOOL_CALLS]`, Granite `<|tool_call|>`, Command-R actions, Functionary, DeepSeek."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable

from app.engine.formats.base import Call, Tools, make_call
from app.engine.formats.calls import ArrayRegion, CallSyntax, EndMarkerRegion, JsonRegion, SectionRegion, ToEndRegion

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


# A JSON call object's tool name, when the object begins with it (as every call grammar writes it).
_JSON_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"')


def json_name(text: str, start: int = 0) -> tuple[str, None] | None:
    """The name of the call object at text[start:] once its "name" string closed (None while unknown)."""
    m = _JSON_NAME.match(text, start)
    return (m.group(1), None) if m else None


def _name_only(named: tuple[str, str | None] | None) -> str | None:
    return named[0] if named else None


def _tokens_start(text: str, pos: int, tokens: tuple[str, ...]) -> int:
    """Past tokens at text[pos:], whitespace allowed between them: -1 while the text may still spell them, -2 if not."""
    for token in tokens:
        while pos < len(text) and text[pos] in _SPACE:
            pos += 1
        got = text[pos:pos + len(token)]
        if got != token:
            return -1 if len(got) < len(token) and token.startswith(got) else -2
        pos += len(token)
    return pos


def _tail(tokens: tuple[str, ...]) -> Callable[[str, int], int]:
    """A region's end after its array: past these tokens (whitespace between), -1 while unknown, -2 if malformed."""
    return lambda text, pos: _tokens_start(text, pos, tokens)


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


def envelope_array_start(text: str) -> int:
    """Where the first call of `{"tool_calls": [` starts (after whitespace or a fence); -1 unknown, -2 another shape."""
    start = fenced_json_start(text)
    return start if start < 0 else _tokens_start(text, start, ("{", '"tool_calls"', ":", "["))


def generic_syntax() -> CallSyntax:
    """Hearth's generic envelope, the whole answer (after whitespace or a fence) one JSON object.

    Its `tool_calls` array hands each call over as soon as its object closes; the envelope's other shapes
    (`{"tool_call": {...}}`, a bare call) are decided whole."""
    def region(tools: Tools):
        return ArrayRegion(tools, envelope_array_start, call_from_object, _tail(("}",)),
                           lambda: JsonRegion(fenced_json_start, lambda _h, v: generic_calls(v, tools)), json_name)
    return CallSyntax(anchored=fenced_json_start, open_anchored=region, after_call=after_fence)


# -- Hermes / Qwen ----------------------------------------------------------------------------

def hermes_syntax() -> CallSyntax:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, anywhere."""
    def region(marker: str, tools: Tools):
        return EndMarkerRegion(len(marker), "</tool_call>",
                               lambda inner: calls_from_list([_loads(inner)], tools) if inner.strip() else None)
    return CallSyntax(markers=("<tool_call>",), open_region=region,
                      call_name=lambda text: _name_only(json_name(text, len("<tool_call>"))))


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
                          bare_json_start, lambda _h, v: calls_from_list([v], tools, "parameters")),
                      call_name=lambda text: _name_only(json_name(text)))


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


def mistral_list_start(text: str) -> int:
    """Where the first call of `[TOOL_CALLS][` starts; -2 for the `name[ARGS]` shape."""
    start = mistral_header(text)
    if start < 0 or text.endswith("[ARGS]", 0, start):
        return -2 if start >= 0 else start
    return start + 1


_MISTRAL_ARGS_NAME = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.\-]+)\[(?:ARGS|CALL_ID)\]")


def mistral_syntax() -> CallSyntax:
    """`[TOOL_CALLS]name[ARGS]{...}` repeated (Mistral Small 3.x, Devstral, Magistral), or `[TOOL_CALLS][{...}]`,
    whose calls go out one by one."""
    def region(marker: str, tools: Tools):
        return ArrayRegion(tools, mistral_list_start, call_from_object, lambda _text, pos: pos,
                           lambda: JsonRegion(mistral_header, lambda h, v: mistral_calls(h, v, tools)), json_name)

    def name(text: str) -> str | None:
        m = _MISTRAL_ARGS_NAME.match(text)
        return m.group(1) if m else None
    return CallSyntax(markers=(MISTRAL_MARK,), open_region=region, call_name=name)


# -- Granite ----------------------------------------------------------------------------------

GRANITE_MARK = "<|tool_call|>"


def granite_header(text: str) -> int:
    """The JSON list right after `<|tool_call|>`."""
    lead = text[len(GRANITE_MARK):].lstrip(_SPACE)
    if not lead:
        return -1
    return len(text) - len(lead) if lead.startswith("[") else -2


def granite_syntax() -> CallSyntax:
    """`<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`, each call out as it closes; `<response>` wrappers
    dropped."""
    def region(marker: str, tools: Tools):
        return ArrayRegion(tools, lambda text: _after(granite_header(text)), call_from_object, lambda _text, pos: pos,
                           lambda: JsonRegion(granite_header, lambda _h, v: calls_from_list(v, tools)), json_name)
    return CallSyntax(markers=(GRANITE_MARK,), dropped=("<response>", "</response>"), open_region=region)


def _after(start: int) -> int:
    """Just past the "[" a header found at start (its -1 and -2 kept)."""
    return start + 1 if start >= 0 else start


# -- Command-R7B ------------------------------------------------------------------------------

def command_r_calls(inner: str, tools: Tools) -> list[Call] | None:
    """`[{"tool_call_id": ..., "tool_name": ..., "parameters": {...}}]`, ids kept."""
    items = _loads(inner)
    if not isinstance(items, list) or not items:
        return None
    calls = [make_call(tools, i.get("tool_name"), i.get("parameters", {}), str(i.get("tool_call_id") or ""))
             if isinstance(i, dict) else None for i in items]
    return None if any(c is None for c in calls) else calls


def command_r_call(item, tools: Tools) -> Call | None:
    """One `{"tool_call_id", "tool_name", "parameters"}` item's call, its id kept."""
    if not isinstance(item, dict):
        return None
    return make_call(tools, item.get("tool_name"), item.get("parameters", {}), str(item.get("tool_call_id") or ""))


_COMMAND_R_NAME = re.compile(r'\s*\{\s*"tool_call_id"\s*:\s*"([^"\\]*)"\s*,\s*"tool_name"\s*:\s*"([^"\\]*)"')


def command_r_name(text: str) -> tuple[str, str | None] | None:
    """An action item's (tool name, id) once both are written (the grammar writes the id first)."""
    m = _COMMAND_R_NAME.match(text)
    return (m.group(2), m.group(1) or None) if m else None


def command_r_syntax() -> CallSyntax:
    """`<|START_ACTION|>[...]<|END_ACTION|>`, each item's call out as it closes; the response and text wrappers
    dropped."""
    def region(marker: str, tools: Tools):
        return ArrayRegion(tools, lambda text: _tokens_start(text, len(marker), ("[",)), command_r_call,
                           _tail(("<|END_ACTION|>",)),
                           lambda: EndMarkerRegion(len(marker), "<|END_ACTION|>",
                                                   lambda inner: command_r_calls(inner, tools)), command_r_name)
    return CallSyntax(markers=("<|START_ACTION|>",),
                      dropped=("<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TEXT|>", "<|END_TEXT|>"),
                      open_region=region)


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


_R1_NAME = re.compile(r"([^\n]+)\n")


def deepseek_name(inner: str) -> tuple[str, None] | None:
    """A unit's tool name once written: R1's after `function<｜tool▁sep｜>` up to its newline, V3.1's before the sep."""
    head, sep, body = inner.partition(DS_SEP)
    if not sep:
        return None
    if head.strip() in ("function", ""):
        m = _R1_NAME.match(body)
        return (m.group(1).strip(), None) if m else None
    return head.strip(), None


def deepseek_syntax() -> CallSyntax:
    """DeepSeek's calls section, each unit's call out as the unit ends (or a lone call unit), R1 and V3.1 alike."""
    def region(marker: str, tools: Tools):
        if marker == DS_CALLS_BEGIN:
            return SectionRegion(tools, len(marker), DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END,
                                 lambda inner: deepseek_unit(inner, tools), deepseek_name,
                                 lambda: EndMarkerRegion(len(marker), DS_CALLS_END,
                                                         lambda inner: deepseek_calls(inner, tools)))
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
    def name(text: str) -> str | None:
        m = _FUNCTION_HEAD.match(text, len("<function=")) if text.startswith("<function=") else None
        return m.group(1) if m else None
    return CallSyntax(markers=("<function=", PYTHON_TAG), open_region=region, call_name=name)


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


def kimi_unit(inner: str, tools: Tools) -> Call | None:
    """One unit's `functions.NAME:0<|tool_call_argument_begin|>{...}` call, its id kept."""
    head, sep, body = inner.partition(KIMI_ARGS)
    m = _KIMI_ID.fullmatch(head)
    return make_call(tools, m.group(2), body.strip(), m.group(1)) if m and sep else None


def kimi_name(inner: str) -> tuple[str, str] | None:
    """A unit's (tool name, id) once its arguments begin."""
    head, sep, _ = inner.partition(KIMI_ARGS)
    m = _KIMI_ID.fullmatch(head) if sep else None
    return (m.group(2), m.group(1)) if m else None


def kimi_syntax() -> CallSyntax:
    """Kimi K2's calls section, each unit's call out as the unit ends; each call's id is its own `functions.NAME:INDEX`."""
    def region(marker: str, tools: Tools):
        return SectionRegion(tools, len(marker), KIMI_SECTION_END, KIMI_CALL_BEGIN, KIMI_CALL_END,
                             lambda inner: kimi_unit(inner, tools), kimi_name,
                             lambda: EndMarkerRegion(len(marker), KIMI_SECTION_END,
                                                     lambda inner: kimi_calls(inner, tools)))
    return CallSyntax(markers=(KIMI_SECTION_BEGIN,), open_region=region)
