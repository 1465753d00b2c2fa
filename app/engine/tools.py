"""Tool calling: prompts, grammars and parsers for the tool-call formats models are trained on.

A model's own chat template receives `tools` when it knows them (Hermes/Qwen `<tool_call>`,
Llama 3.x JSON, Mistral `[TOOL_CALLS]`); a template without tool support (the embedded Gemma 3)
gets the generic format: the tool definitions in the system turn and a JSON envelope
`{"tool_calls": [{"name": ..., "arguments": {...}}]}` for calls. The model's text is parsed back
into OpenAI `tool_calls`; whatever cannot be parsed into a whole, valid call stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from app.engine.grammar import Grammar, tool_call_grammar

GENERIC = "generic"
HERMES = "hermes"
LLAMA3 = "llama3"
MISTRAL = "mistral"
FORMATS = (GENERIC, HERMES, LLAMA3, MISTRAL)

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
# The generic envelope may open after whitespace or a Markdown fence; only then is it a call.
_GENERIC_START = re.compile(r"^\s*(?:```(?:json)?\s*)?(\{)")
_BRACKET_START = re.compile(r"^\s*(\[)")


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments as a JSON object string."""

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
class Parsed:
    """A model answer split into content and calls."""

    content: str
    calls: tuple[ToolCall, ...] = ()


def detect_format(template_source: str | None) -> str:
    """The tool-call format a chat template was written for (GENERIC when it has none)."""
    src = template_source or ""
    if "tools" not in src:
        return GENERIC
    if HERMES_OPEN in src:
        return HERMES
    if MISTRAL_MARK in src:
        return MISTRAL
    if PYTHON_TAG in src or "<|start_header_id|>" in src:
        return LLAMA3
    return GENERIC


def tool_functions(tools: list[dict]) -> list[dict]:
    """The `function` objects of OpenAI tools ({name, description, parameters})."""
    return [t["function"] for t in tools]


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# -- prompt -------------------------------------------------------------------------------------

def signature(schema: dict | None) -> str:
    """A compact, readable rendering of a JSON Schema (names, types, enums): far fewer prompt tokens."""
    if not schema:
        return "any"
    if "enum" in schema:
        return "|".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"], ensure_ascii=False)
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    if alternatives:
        return " or ".join(signature(a) for a in alternatives)
    kind = schema.get("type", "any")
    if isinstance(kind, list):
        return " or ".join(signature({**schema, "type": k}) for k in kind)
    if kind == "array":
        return f"[{signature(schema.get('items'))}, ...]"
    if kind == "object" and "properties" in schema:
        required = set(schema.get("required", []))
        parts = [f"{name}{'' if name in required else '?'}: {signature(sub)}"
                 for name, sub in schema["properties"].items()]
        return "{" + ", ".join(parts) + "}"
    if kind == "integer" and "minimum" in schema and "maximum" in schema:
        return f"integer {schema['minimum']}..{schema['maximum']}"
    return str(kind)


def generic_instructions(tools: list[dict], choice, parallel: bool) -> str:
    """The system text that teaches a template without tool support the generic JSON envelope."""
    lines = ["You can call these tools (? marks an optional argument):"]
    for f in tool_functions(tools):
        params = f.get("parameters") or {"type": "object", "properties": {}}
        described = f" - {f['description']}" if f.get("description") else ""
        lines.append(f"{f['name']}{signature({**params, 'type': 'object', 'properties': params.get('properties', {})})}"
                     f"{described}")
    many = "one or more calls" if parallel else "exactly one call"
    lines.append(f'To call tools, reply with only this JSON ({many}) and nothing else: '
                 '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}')
    if choice == "required" or isinstance(choice, dict):
        lines.append("You must call a tool now.")
    else:
        lines.append("If no tool is needed, answer the user directly in plain text.")
    return "\n".join(lines)


def _arguments_object(arguments) -> object:
    """Arguments as templates expect them (an object), whether sent as a JSON string or not."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def prepare_messages(messages: list[dict], fmt: str, tools: list[dict] | None, choice, parallel: bool) -> list[dict]:
    """Messages ready for the template: tool history converted for the generic format, else unchanged."""
    if fmt != GENERIC:
        # A template that takes tools gets the history as it is: the chat template's own input preparation
        # (app.engine.template_inputs) hands arguments over as objects where the template reads them so.
        return [dict(m) for m in messages]
    names_by_id: dict[str, str] = {}
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m.get("content")
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                names_by_id[c.get("id") or ""] = c["function"]["name"]
                calls.append({"name": c["function"]["name"], "arguments": _arguments_object(c["function"]["arguments"])})
            text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            content = f"{_text(content)}\n{text}" if _text(content) else text
            m = {"role": "assistant", "content": content}
        elif role == "tool":
            name = m.get("name") or names_by_id.get(m.get("tool_call_id") or "", "the tool")
            m = {"role": "user", "content": f"Result of {name}: {_text(content)}"}
        else:
            m = dict(m)  # its other fields too (an earlier turn's reasoning_content)
        # Templates such as Gemma's want strictly alternating turns: tool results become user turns,
        # so consecutive ones are joined.
        if out and out[-1]["role"] == m["role"] and m["role"] in ("user", "assistant"):
            out[-1] = {**out[-1], "content": f"{_text(out[-1]['content'])}\n\n{_text(m['content'])}"}
        else:
            out.append(m)
    if tools and choice != "none":
        instructions = generic_instructions(tools, choice, parallel)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{_text(out[0]['content'])}\n\n{instructions}"}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


# -- grammar ------------------------------------------------------------------------------------

def chosen_tools(tools: list[dict], choice) -> list[dict]:
    """The tools a call may use under tool_choice (one for a named function)."""
    if isinstance(choice, dict):
        name = choice.get("function", {}).get("name")
        return [t for t in tools if t["function"]["name"] == name]
    return tools


def call_grammar(tools: list[dict], fmt: str, choice, parallel: bool, trigger_tokens: tuple[int, ...] = ()) -> Grammar | None:
    """The grammar for tool_choice: exact for required/named, lazy for auto, none for none."""
    if not tools or choice == "none":
        return None
    specs = [(f["name"], f.get("parameters") or {}) for f in tool_functions(chosen_tools(tools, choice))]
    lazy = not (choice == "required" or isinstance(choice, dict))
    args_key = "parameters" if fmt == LLAMA3 else "arguments"
    patterns: tuple[str, ...] = ()
    if lazy:
        patterns = {
            GENERIC: (_GENERIC_START.pattern,),
            LLAMA3: (r"^\s*(\{)",),
            HERMES: (r"(<tool_call>)",),
            MISTRAL: (r"(\[TOOL_CALLS\])",),
        }[fmt]
    return tool_call_grammar(specs, fmt, parallel, args_key=args_key, lazy=lazy, trigger_patterns=patterns,
                             trigger_tokens=trigger_tokens if lazy else ())


# -- parsing ------------------------------------------------------------------------------------

def _call_from(obj, names: set[str], args_key: str = "arguments") -> ToolCall | None:
    """A ToolCall from {"name", "arguments"} if it names an offered tool with object arguments."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters")))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if args is None and set(obj) == {"name"}:
        args = {}
    if not isinstance(name, str) or name not in names or not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False), _new_id())


def _decode_prefix(text: str, start: int) -> tuple[object, int] | None:
    """The JSON value at text[start:] and where it ends, or None."""
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None


def _strip_fence(rest: str) -> str:
    rest = rest.strip()
    return rest[3:].strip() if rest.startswith("```") else rest


def _parse_generic(region: str, names: set[str], args_key: str = "arguments") -> Parsed:
    start = region.find("{")
    decoded = _decode_prefix(region, start) if start >= 0 else None
    if decoded is None:
        return Parsed(region)
    obj, end = decoded
    if isinstance(obj, dict) and "tool_calls" in obj:
        items = obj["tool_calls"] if isinstance(obj["tool_calls"], list) else None
    elif isinstance(obj, dict) and "tool_call" in obj:
        items = [obj["tool_call"]]
    else:
        items = [obj]
    calls = [_call_from(i, names, args_key) for i in items or []]
    if not calls or any(c is None for c in calls):
        return Parsed(region)
    # Further `;`-separated calls (Llama 3.x with parallel calls).
    rest = region[end:]
    while rest.lstrip().startswith(";"):
        body = rest.lstrip()[1:].lstrip()
        nxt = _decode_prefix(body, 0)
        call = _call_from(nxt[0], names, args_key) if nxt else None
        if call is None:
            break
        calls.append(call)
        rest = body[nxt[1]:]
    return Parsed(_strip_fence(rest), tuple(calls))


def _parse_hermes(region: str, names: set[str]) -> Parsed:
    calls: list[ToolCall] = []
    content: list[str] = []
    pos = 0
    while True:
        open_at = region.find(HERMES_OPEN, pos)
        if open_at < 0:
            content.append(region[pos:])
            break
        content.append(region[pos:open_at])
        body_at = open_at + len(HERMES_OPEN)
        close_at = region.find(HERMES_CLOSE, body_at)
        end = len(region) if close_at < 0 else close_at + len(HERMES_CLOSE)
        inner = region[body_at: close_at if close_at >= 0 else len(region)].strip()
        decoded = _decode_prefix(inner, 0) if inner.startswith("{") else None
        call = _call_from(decoded[0], names) if decoded and not inner[decoded[1]:].strip() else None
        if call is None:
            content.append(region[open_at:end])  # a broken call stays text, whole
        else:
            calls.append(call)
        pos = end
    return Parsed("".join(content), tuple(calls))


def _parse_mistral(region: str, names: set[str]) -> Parsed:
    body = region[len(MISTRAL_MARK):] if region.startswith(MISTRAL_MARK) else region
    body = body.strip()
    if body.startswith("["):
        decoded = _decode_prefix(body, 0)
        if decoded is None or not isinstance(decoded[0], list) or not decoded[0]:
            return Parsed(region)
        calls = [_call_from(i, names) for i in decoded[0]]
        if any(c is None for c in calls):
            return Parsed(region)
        return Parsed(body[decoded[1]:].strip(), tuple(calls))
    # Newer Mistral templates: [TOOL_CALLS]name[ARGS]{...}, repeated.
    calls = []
    for part in region.split(MISTRAL_MARK)[1:]:
        name, sep, args = part.partition("[ARGS]")
        decoded = _decode_prefix(args.strip(), 0) if sep else None
        call = _call_from({"name": name.strip(), "arguments": decoded[0]}, names) if decoded else None
        if call is None:
            return Parsed(region)
        calls.append(call)
    return Parsed("", tuple(calls)) if calls else Parsed(region)


def split_region(text: str, fmt: str) -> int | None:
    """Where the tool-call region of a (partial) answer begins; None while it is plain content."""
    if fmt in (GENERIC, LLAMA3):
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG):
            return len(text) - len(stripped)
        return len(text) - len(stripped) if _GENERIC_START.match(text) else None
    marker = HERMES_OPEN if fmt == HERMES else MISTRAL_MARK
    at = text.find(marker)
    if at >= 0:
        return at
    if fmt == MISTRAL:
        m = _BRACKET_START.match(text)
        return m.start(1) if m else None
    return None


def parse(text: str, fmt: str, tools: list[dict]) -> Parsed:
    """Split a whole answer into content and calls; a malformed call stays content, never half a call."""
    names = {f["name"] for f in tool_functions(tools)}
    start = split_region(text, fmt)
    if start is None:
        return Parsed(text)
    pre, region = text[:start], text[start:]
    if fmt == HERMES:
        parsed = _parse_hermes(region, names)
    elif fmt == MISTRAL:
        parsed = _parse_mistral(region, names)
    else:
        if region.startswith(PYTHON_TAG):
            region = region[len(PYTHON_TAG):]
        parsed = _parse_generic(region, names, "parameters" if fmt == LLAMA3 else "arguments")
        if not parsed.calls:
            return Parsed(text)
    return Parsed(pre + parsed.content, parsed.calls)


class ToolStream:
    """Streams an answer's content as it comes, holding back a tool-call region until it is complete."""

    _MARKERS = {HERMES: HERMES_OPEN, MISTRAL: MISTRAL_MARK}

    def __init__(self, fmt: str, tools: list[dict]):
        self.fmt = fmt
        self.tools = tools
        self._text = ""
        self._sent = 0  # characters of _text already emitted as content
        self._region: int | None = None

    def push(self, piece: str) -> str:
        """Adds generated text; returns the content that is safe to send now."""
        self._text += piece
        if self._region is None:
            self._region = split_region(self._text, self.fmt)
        if self._region is None:
            safe = len(self._text) - self._hold()
        else:
            # Whitespace just before a call is not worth a content delta of its own.
            safe = len(self._text[: self._region].rstrip())
        out = self._text[self._sent:safe]
        self._sent = max(self._sent, safe)
        return out

    def _hold(self) -> int:
        """Characters at the end that could still begin a call region."""
        text = self._text
        if self.fmt in (GENERIC, LLAMA3, MISTRAL) and not text.strip():
            return len(text)  # only whitespace so far: a call may still open
        if self.fmt in (GENERIC, LLAMA3) and text.lstrip().startswith("`") and len(text.lstrip()) < 8:
            return len(text)  # may be a fence before the envelope
        marker = self._MARKERS.get(self.fmt)
        if marker:
            for size in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:size]):
                    return size
        return 0

    def finish(self) -> Parsed:
        """Ends the answer: content not yet sent, and the parsed calls."""
        parsed = parse(self._text, self.fmt, self.tools)
        sent = self._text[: self._sent]
        rest = parsed.content[len(sent):] if parsed.content.startswith(sent) else parsed.content
        return Parsed(rest, parsed.calls)
