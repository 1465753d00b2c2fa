"""Tool calling's prompt side: the messages a template gets when a request offers tools.

A model's own chat template receives `tools` when it knows them (Hermes/Qwen `<tool_call>`,
Llama 3.x JSON, Mistral `[TOOL_CALLS]`); a template without tool support (the embedded Gemma 3)
gets the generic format: the tool definitions in the system turn and a JSON envelope
`{"tool_calls": [{"name": ..., "arguments": {...}}]}` for calls. Answers are parsed back, and calls
constrained, by the families' answer formats (app.engine.formats).
"""

from __future__ import annotations

import json

GENERIC = "generic"
HERMES = "hermes"
LLAMA3 = "llama3"
MISTRAL = "mistral"
FORMATS = (GENERIC, HERMES, LLAMA3, MISTRAL)


def tool_functions(tools: list[dict]) -> list[dict]:
    """The `function` objects of OpenAI tools ({name, description, parameters})."""
    return [t["function"] for t in tools]


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
