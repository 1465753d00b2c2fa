"""The JSON Schema subset Hearth can honour when it constrains output, checked at the door.

A schema arrives in a request (response_format, a tool's parameters, Ollama's format) and is
checked here, with no engine and no HTTP, so a request naming a keyword the grammar converter would
silently ignore is refused as it is read. `normalise_schema` returns the checked copy the engine's
grammar converter (app.engine.grammar) renders.
"""

from __future__ import annotations

import copy
import math
import re

# Keywords the converter turns into grammar rules.
HONOURED = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
    "maxItems", "enum", "const", "anyOf", "oneOf", "$ref", "$defs", "definitions", "pattern",
    "format", "minLength", "maxLength", "minimum", "maximum",
})

# Keywords that say nothing about which values are valid.
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "strict", "nullable",
})
FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"})
TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})


class UnsupportedSchema(ValueError):
    """A JSON Schema keyword (or value) that constrained decoding cannot honour."""

    def __init__(self, keyword: str, path: str):
        where = path or "the schema's root"
        super().__init__(f"JSON Schema keyword '{keyword}' (at {where}) is not supported for constrained output; "
                         f"supported: {', '.join(sorted(HONOURED))}")
        self.keyword = keyword
        self.path = path


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
RANGE_LITERAL = re.compile(r'"\\"__hearth_integer_range_(-?\d+)_(-?\d+)__\\""')


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

