"""Families whose calls are not JSON: Qwen3-Coder / Qwen3.5 / Nemotron XML parameters, Functionary v3.2 recipients."""

from __future__ import annotations

import json
import re

from app.engine.formats.base import Call, JsonEnd, Tools, make_call
from app.engine.formats.calls import CallSyntax, EndMarkerRegion, Region

# -- Qwen3-Coder XML --------------------------------------------------------------------------

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*$", re.DOTALL)
_FUNCTION_NAME = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _is_string(schema) -> bool:
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind == "string" or (isinstance(kind, list) and kind and all(k in ("string", "null") for k in kind))


def typed_value(raw: str, schema) -> object:
    """A parameter's text as its schema types it: strings as written, anything else read as JSON (else the text)."""
    if not isinstance(schema, dict) or _is_string(schema) or not schema:
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def xml_call(inner: str, tools: Tools) -> list[Call] | None:
    """`<function=NAME><parameter=P>VALUE</parameter>...</function>`: the parameters made into a JSON object."""
    m = _FUNCTION.match(inner)
    if m is None:
        return None
    name, body = m.group(1).strip(), m.group(2)
    if name not in tools:
        return None
    properties = tools.schemas[name].get("properties") or {}
    args, pos = {}, 0
    for p in _PARAMETER.finditer(body):
        if body[pos:p.start()].strip():
            return None
        key = p.group(1).strip()
        args[key] = typed_value(p.group(2), properties.get(key))
        pos = p.end()
    if body[pos:].strip():
        return None
    call = make_call(tools, name, args)
    return [call] if call else None


def qwen3_coder_syntax() -> CallSyntax:
    """`<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>` (or bare `<function=`)."""
    def region(marker: str, tools: Tools):
        if marker == "<function=":
            return EndMarkerRegion(0, "</function>", lambda inner: xml_call(inner + "</function>", tools),
                                   lenient=False)
        return EndMarkerRegion(len(marker), "</tool_call>", lambda inner: xml_call(inner, tools))
    def name(text: str) -> str | None:
        m = _FUNCTION_NAME.search(text, 0, 64)
        return m.group(1).strip() if m else None
    return CallSyntax(markers=("<tool_call>", "<function="), open_region=region, call_name=name)


# -- Functionary v3.2 -------------------------------------------------------------------------

RECIPIENT = ">>>"
_MAX_NAME = 64


class RecipientRegion(Region):
    """`NAME\\n{json}` after `>>>` (the prompt ends with the first `>>>`); `all\\n` is content; python gets code."""

    __slots__ = ("open_len", "tools", "body", "json_end", "code", "searched")

    def __init__(self, open_len: int, tools: Tools):
        self.open_len, self.tools = open_len, tools
        self.body = -1
        self.json_end: JsonEnd | None = None
        self.code: bool | None = None  # python code rather than JSON arguments, once known
        self.searched = 0

    def feed(self, text):
        if self.body < 0:
            newline = text.find("\n", self.open_len)
            if newline == -1:
                return (None, self._resume) if len(text) - self.open_len > _MAX_NAME else None
            name = text[self.open_len:newline].strip()
            if name == "all":
                return [], newline + 1
            if name not in self.tools:
                return None, self._resume
            self.body, self.searched = newline + 1, newline + 1
            self.json_end = JsonEnd(self.body)
        if self.code is None:
            rest = text[self.body:self.body + 64].lstrip()
            if not rest:
                return None
            self.code = self._name(text) == "python" and not rest.startswith("{")
        if self.code:
            at = text.find(RECIPIENT, max(self.body, self.searched - len(RECIPIENT)))
            self.searched = len(text)
            return (self._code_call(text[self.body:at]), at) if at >= 0 else None
        end = self.json_end.scan(text)
        if end == -1:
            return None
        if end == -2:
            return None, len(text)
        call = make_call(self.tools, self._name(text), text[self.body:end])
        return ([call] if call else None), end

    def finish(self, text):
        if self.code:
            return self._code_call(text[self.body:]), len(text)
        return None, len(text)

    @property
    def _resume(self) -> int:
        """A recipient that names no tool is content up to just past its `>>>` (or first character); scanning resumes there."""
        return max(self.open_len, 1)

    def _name(self, text: str) -> str:
        return text[self.open_len:self.body - 1].strip()

    def _code_call(self, code: str) -> list[Call] | None:
        call = make_call(self.tools, "python", {"code": code})
        return [call] if call else None


def functionary_v3_2_syntax() -> CallSyntax:
    """`all\\ntext>>>NAME\\n{...}>>>NAME2\\n{...}`: each recipient a segment."""
    return CallSyntax(markers=(RECIPIENT,),
                      open_region=lambda marker, tools: RecipientRegion(len(marker), tools),
                      anchored=lambda text: 0, open_anchored=lambda tools: RecipientRegion(0, tools),
                      anchored_always=True, call_name=recipient_name)


def recipient_name(text: str) -> str | None:
    """A recipient's name once its line ends (`>>>NAME\n`, or `NAME\n` at the answer's start)."""
    start = len(RECIPIENT) if text.startswith(RECIPIENT) else 0
    newline = text.find("\n", start, start + _MAX_NAME + 1)
    return text[start:newline].strip() if newline != -1 else None
