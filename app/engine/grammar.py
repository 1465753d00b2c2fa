"""Grammars for constrained decoding: JSON Schema → GBNF, JSON mode, tool-call envelopes.

The conversion is llama-cpp-python's own port of llama.cpp's json-schema-to-grammar (pure Python,
no model needed), run once per distinct schema and cached. Before converting, a schema is checked:
a keyword the converter would silently ignore (minimum, uniqueItems, ...) is refused by name, since
an answer "valid against the schema" that breaks it would be a lie. The result is a `Grammar`, the
value the engine's sampler is built from; llama.cpp parses it (and the model layer caches that too).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from app.schema_subset import RANGE_LITERAL, UnsupportedSchema, normalise_schema

# Arrays in tool-call arguments without maxItems get this bound: a small model copying an enum from
# the prompt would otherwise list every value until max_tokens and never close the call.
MAX_CALL_ARRAY_ITEMS = 4
# Likewise for parallel calls: a household request rarely needs more, a small model may not stop.
MAX_PARALLEL_CALLS = 3


# JSON forbids raw control characters inside strings; the converter's `char` rule allows them.
_JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
# At most one space between tokens: a small model given free whitespace can fill max_tokens with it.
_SPACE = '" "?'


@dataclass(frozen=True)
class Grammar:
    """A GBNF grammar for one sequence's sampler; lazy ones engage when a trigger appears in the output."""

    gbnf: str
    root: str = "root"
    lazy: bool = False
    # Regexes matched against the whole output so far (llama.cpp's lazy grammar); the grammar
    # constrains from the first capturing group on.
    trigger_patterns: tuple[str, ...] = ()
    trigger_tokens: tuple[int, ...] = ()
    kind: str = "json_schema"  # json_schema | json_object | tools, for logs and counters


def _same_length(a: str, b: str) -> list[str]:
    """GBNF alternatives for the integers a..b written with the same number of digits."""
    if a == b:
        return [" ".join(f'"{c}"' for c in a)]
    if len(a) == 1:
        return [f"[{a}-{b}]"]
    tail = len(a) - 1
    if a[1:] == "0" * tail and b[1:] == "9" * tail:
        return [f"[{a[0]}-{b[0]}]" + " [0-9]" * tail]
    if a[0] == b[0]:
        return [f'"{a[0]}" {x}' for x in _same_length(a[1:], b[1:])]
    out = [f'"{a[0]}" {x}' for x in _same_length(a[1:], "9" * tail)]
    if int(b[0]) - int(a[0]) > 1:
        out.append(f"[{int(a[0]) + 1}-{int(b[0]) - 1}]" + " [0-9]" * tail)
    out += [f'"{b[0]}" {x}' for x in _same_length("0" * tail, b[1:])]
    return out


def _non_negative_range(low: int, high: int) -> list[str]:
    out = []
    for digits in range(len(str(low)), len(str(high)) + 1):
        a = max(low, 10 ** (digits - 1) if digits > 1 else 0)
        b = min(high, 10**digits - 1)
        if a <= b:
            out += _same_length(str(a), str(b))
    return out


def integer_range_rule(low: int, high: int) -> str:
    """A GBNF expression matching exactly the integers low..high in JSON (no leading zeros)."""
    alternatives = []
    if low < 0:
        alternatives += [f'"-" {x}' for x in _non_negative_range(max(1, -high), -low)]
    if high >= 0:
        alternatives += _non_negative_range(max(0, low), high)
    return "(" + " | ".join(alternatives) + ")"


def _bound_arrays(schema):
    """A copy of schema whose arrays without maxItems hold at most MAX_CALL_ARRAY_ITEMS."""
    if isinstance(schema, list):
        return [_bound_arrays(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bound_arrays(v) if k not in ("enum", "const") else v for k, v in schema.items()}
    if out.get("type") == "array" and "maxItems" not in out and "prefixItems" not in out:
        out["maxItems"] = max(MAX_CALL_ARRAY_ITEMS, out.get("minItems", 0))
    return out


def _converter():
    # Imported here: the gateway validates schemas with this module and never loads llama.cpp.
    from llama_cpp.llama_grammar import SchemaConverter

    return SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def _finish(converter) -> str:
    rules = converter._rules
    rules["space"] = _SPACE
    if "char" in rules:
        rules["char"] = _JSON_CHAR
    text = converter.format_grammar()
    return RANGE_LITERAL.sub(lambda m: integer_range_rule(int(m.group(1)), int(m.group(2))), text)


def _visit(converter, schema: dict, name: str) -> str:
    """Adds schema's rules to the converter; returns the name of its top rule."""
    resolved = converter.resolve_refs(schema, "input")
    try:
        return converter.visit(resolved, name)
    except (AssertionError, KeyError, ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise UnsupportedSchema(f"not convertible ({type(exc).__name__}: {exc})", name) from exc


@functools.lru_cache(maxsize=256)
def _schema_gbnf(canonical: str) -> str:
    converter = _converter()
    _visit(converter, json.loads(canonical), "")
    return _finish(converter)


def schema_grammar(schema: dict) -> Grammar:
    """The grammar of JSON values valid against schema (cached per schema)."""
    normalised = normalise_schema(schema)
    return Grammar(_schema_gbnf(json.dumps(normalised)), kind="json_schema")


def json_object_grammar() -> Grammar:
    """Any JSON object (OpenAI's JSON mode)."""
    return Grammar(_schema_gbnf(json.dumps({"type": "object"})), kind="json_object")


@functools.lru_cache(maxsize=128)
def _calls_gbnf(canonical: str, wrapper: str) -> str:
    spec = json.loads(canonical)
    converter = _converter()
    alternatives = []
    for i, (name, parameters) in enumerate(spec["tools"]):
        args = _visit(converter, parameters, f"tool{i}-args")
        key = spec["args_key"]
        alternatives.append(converter._add_rule(
            f"tool{i}-call",
            rf'"{{" space "\"name\"" space ":" space {converter._format_literal(json.dumps(name))} space "," space '
            rf'"\"{key}\"" space ":" space {args} "}}" space'))
    converter._add_rule("call", " | ".join(alternatives))

    def more(separator: str) -> str:
        return f" ({separator}){{0,{MAX_PARALLEL_CALLS - 1}}}" if spec["parallel"] else ""

    calls = "call" + more('"," space call')
    if wrapper == "generic":
        root = rf'"{{" space "\"tool_calls\"" space ":" space "[" space {calls} "]" space "}}" space'
    elif wrapper == "hermes":
        one = r'"<tool_call>" "\n"? space call "\n"? "</tool_call>" "\n"?'
        root = one + more(one)
    elif wrapper == "mistral":
        root = f'"[TOOL_CALLS]" space "[" space {calls} "]"'
    else:  # llama3: one bare JSON object per call, `;`-separated
        root = "call" + more('";" space call')
    converter._rules["root"] = root
    return _finish(converter)


def tool_call_grammar(tools: list[tuple[str, dict]], wrapper: str, parallel: bool, args_key: str = "arguments",
                      lazy: bool = False, trigger_patterns: tuple[str, ...] = (),
                      trigger_tokens: tuple[int, ...] = ()) -> Grammar:
    """A grammar admitting only calls to these (name, parameters schema) tools in a format's envelope."""
    checked = [(name, _bound_arrays(normalise_schema(params or {"type": "object"}, f"tools[{name}].parameters")))
               for name, params in tools]
    # An empty parameters schema means "no arguments" in OpenAI's tool format, not "anything".
    checked = [(n, p if p else {"type": "object"}) for n, p in checked]
    canonical = json.dumps({"tools": checked, "parallel": parallel, "args_key": args_key})
    return Grammar(_calls_gbnf(canonical, wrapper), lazy=lazy, trigger_patterns=trigger_patterns,
                   trigger_tokens=trigger_tokens, kind="tools")
