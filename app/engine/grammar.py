"""Grammars for constrained decoding: JSON Schema → GBNF, JSON mode, tool-call envelopes.

The conversion is llama-cpp-python's own port of llama.cpp's json-schema-to-grammar (pure Python,
no model needed), run once per distinct schema and cached. Before converting, a schema is checked:
a keyword the converter would silently ignore (minimum, uniqueItems, ...) is refused by name, since
an answer "valid against the schema" that breaks it would be a lie. The result is a `Grammar`, the
value the engine's sampler is built from; llama.cpp parses it (and the model layer caches that too).
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
from dataclasses import dataclass

# Keywords the converter turns into grammar rules.
HONOURED = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
    "maxItems", "enum", "const", "anyOf", "oneOf", "$ref", "$defs", "definitions", "pattern",
    "format", "minLength", "maxLength", "minimum", "maximum",
})
# Arrays in tool-call arguments without maxItems get this bound: a small model copying an enum from
# the prompt would otherwise list every value until max_tokens and never close the call.
MAX_CALL_ARRAY_ITEMS = 4
# Likewise for parallel calls: a household request rarely needs more, a small model may not stop.
MAX_PARALLEL_CALLS = 3

# Keywords that say nothing about which values are valid.
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "strict", "nullable",
})
FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"})
TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})

# JSON forbids raw control characters inside strings; the converter's `char` rule allows them.
_JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
# At most one space between tokens: a small model given free whitespace can fill max_tokens with it.
_SPACE = '" "?'


class UnsupportedSchema(ValueError):
    """A JSON Schema keyword (or value) that constrained decoding cannot honour."""

    def __init__(self, keyword: str, path: str):
        where = path or "the schema's root"
        super().__init__(f"JSON Schema keyword '{keyword}' (at {where}) is not supported for constrained output; "
                         f"supported: {', '.join(sorted(HONOURED))}")
        self.keyword = keyword
        self.path = path


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


# The JSON type each structural keyword must have; anything else is a malformed schema.
_SHAPES = {"properties": dict, "$defs": dict, "definitions": dict, "required": list, "enum": list,
           "anyOf": list, "oneOf": list, "prefixItems": list, "items": (dict, bool),
           "additionalProperties": (dict, bool), "minItems": int, "maxItems": int, "minLength": int,
           "maxLength": int, "pattern": str, "format": str, "$ref": str}


def normalise_schema(schema, path: str = "") -> dict:
    """A checked copy of schema that the converter renders faithfully; raises UnsupportedSchema."""
    try:
        return _normalise(schema, path)
    except UnsupportedSchema:
        raise
    except (TypeError, AttributeError, ValueError, KeyError) as exc:
        raise UnsupportedSchema(f"malformed schema ({type(exc).__name__}: {exc})", path) from exc


def _normalise(schema, path: str) -> dict:
    if schema is True or schema == {}:
        return {}
    if not isinstance(schema, dict):
        raise UnsupportedSchema(type(schema).__name__, path)
    if isinstance(schema.get("items"), list) and "prefixItems" not in schema:
        # Draft 4's tuple form (items as a list) is today's prefixItems, as llama-server reads it.
        schema = {**{k: v for k, v in schema.items() if k != "items"}, "prefixItems": schema["items"]}
    out: dict = {}
    for key, value in schema.items():
        here = f"{path}.{key}" if path else key
        if key in ANNOTATIONS:
            continue
        if key not in HONOURED:
            raise UnsupportedSchema(key, path)
        shape = _SHAPES.get(key)
        if shape is not None and (not isinstance(value, shape) or (shape is int and isinstance(value, bool))):
            raise UnsupportedSchema(f"{key} of the wrong type", path)
        if key == "properties":
            out[key] = {name: _normalise(sub, f"{here}.{name}") for name, sub in value.items()}
        elif key in ("$defs", "definitions"):
            out[key] = {name: _normalise(sub, f"{here}.{name}") for name, sub in value.items()}
        elif key in ("anyOf", "oneOf", "prefixItems"):
            out[key] = [_normalise(sub, f"{here}[{i}]") for i, sub in enumerate(value)]
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _normalise(value, here)
        elif key == "required" and not all(isinstance(v, str) for v in value):
            raise UnsupportedSchema("required of the wrong type", path)
        elif key == "format" and value not in FORMATS:
            raise UnsupportedSchema(f"format: {value}", path)
        elif key == "type":
            types = value if isinstance(value, list) else [value]
            bad = next((t for t in types if t not in TYPES), None)
            if bad is not None:
                raise UnsupportedSchema(f"type: {bad}", path)
            out[key] = value
        elif key == "$ref" and not str(value).startswith("#/"):
            raise UnsupportedSchema(f"$ref: {value}", path)
        else:
            out[key] = copy.deepcopy(value)
    if "minimum" in out or "maximum" in out:
        out = _integer_range(out, path)
    if "oneOf" in out:
        # Alternatives that overlap would need "exactly one"; as a grammar oneOf is anyOf.
        out["anyOf"] = out.pop("oneOf")
    if "enum" in out or "const" in out:
        # The converter checks a list type before enum/const and would drop the values.
        out.pop("type", None)
    elif isinstance(out.get("type"), list):
        # ["string", "null"] with minLength etc.: one alternative per type, each with the keywords
        # that apply to it, so none is lost.
        rest = {k: v for k, v in out.items() if k != "type"}
        out = {"anyOf": [{**rest, "type": t} if t != "null" else {"type": "null"} for t in out["type"]]}
    if "anyOf" in out:
        # The converter renders anyOf alone and would ignore keywords beside it.
        beside = next((k for k in ("type", "properties", "required", "items", "additionalProperties") if k in out), None)
        if beside is not None:
            raise UnsupportedSchema(f"{beside} beside anyOf", path)
    return out


_RANGE_MARK = "__hearth_integer_range_{}_{}__"
_RANGE_LITERAL = re.compile(r'"\\"__hearth_integer_range_(-?\d+)_(-?\d+)__\\""')


def _integer_range(schema: dict, path: str) -> dict:
    """An integer schema with bounds as a placeholder the GBNF gets a digit-wise range rule for."""
    low, high = schema.get("minimum"), schema.get("maximum")
    keyword = "minimum" if low is not None else "maximum"
    if schema.get("type") != "integer" or not all(isinstance(v, int | float) and not isinstance(v, bool)
                                                   for v in (low, high) if v is not None):
        raise UnsupportedSchema(keyword, path)
    if high is None:
        if low is None or low < 0 or low > 1:
            raise UnsupportedSchema(f"{keyword} (open ranges only from 0 or 1)", path)
        high = 10**15 - 1
    if low is None:
        raise UnsupportedSchema("maximum (without minimum)", path)
    low, high = math.ceil(low), math.floor(high)
    if low > high:
        raise UnsupportedSchema("minimum above maximum", path)
    return {"const": _RANGE_MARK.format(low, high)}


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
    return _RANGE_LITERAL.sub(lambda m: integer_range_rule(int(m.group(1)), int(m.group(2))), text)


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
