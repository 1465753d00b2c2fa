"""JSON Schema checks and conversion: what is honoured, what is refused by name, caching."""

import re

import pytest

from app.engine.grammar import (
    UnsupportedSchema,
    integer_range_rule,
    normalise_schema,
    schema_grammar,
    tool_call_grammar,
)

HA_TASK = {
    "type": "object",
    "properties": {"room": {"type": ["string", "null"], "maxLength": 20},
                   "level": {"type": "string", "enum": ["low", "high"]},
                   "count": {"type": ["integer", "null"]}},
    "required": ["room", "level", "count"],
    "additionalProperties": False,
}


def test_nullable_type_lists_keep_their_other_keywords():
    out = normalise_schema(HA_TASK)
    assert out["properties"]["room"] == {"anyOf": [{"maxLength": 20, "type": "string"}, {"type": "null"}]}
    gbnf = schema_grammar(HA_TASK).gbnf
    assert '"\\"room\\""' in gbnf and "null" in gbnf and '"\\"low\\""' in gbnf


def test_enum_beside_a_type_list_is_not_dropped():
    assert normalise_schema({"type": ["string", "null"], "enum": ["a", None]}) == {"enum": ["a", None]}


def _as_regex(rule: str) -> re.Pattern:
    """The GBNF of integer_range_rule as a Python regex (its only parts: literals, classes, |)."""
    return re.compile(rule.replace('"', "").replace(" ", ""))


@pytest.mark.parametrize("low,high", [(0, 100), (0, 1000), (1, 9), (-15, 7), (-100, -3), (7, 7), (19, 2341), (0, 0)])
def test_integer_ranges_match_exactly_their_values(low, high):
    pattern = _as_regex(integer_range_rule(low, high))
    for n in range(low - 30, high + 31):
        assert bool(pattern.fullmatch(str(n))) == (low <= n <= high), n
    assert not pattern.fullmatch("00")


def test_ranges_are_honoured_and_open_or_float_ones_refused():
    gbnf = schema_grammar({"type": "object", "properties": {"b": {"type": "integer", "minimum": 0, "maximum": 100}},
                           "required": ["b"]}).gbnf
    assert '"1" "0" "0"' in gbnf and "__hearth" not in gbnf
    with pytest.raises(UnsupportedSchema, match="'minimum"):
        normalise_schema({"type": "integer", "minimum": 5})
    with pytest.raises(UnsupportedSchema, match="'maximum"):
        normalise_schema({"type": "number", "maximum": 1.5})


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "email"}}}, "format: email"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties"),
    ({"$ref": "https://example.com/s.json"}, "$ref: https://example.com/s.json"),
    ({"type": "integer", "multipleOf": 2}, "multipleOf"),
    ({"allOf": [{"type": "string"}]}, "allOf"),
])
def test_unsupported_keywords_are_named(schema, keyword):
    with pytest.raises(UnsupportedSchema) as exc:
        normalise_schema(schema)
    assert exc.value.keyword == keyword
    assert keyword in str(exc.value)


def test_annotations_and_pydantic_refs_pass():
    schema = {"$defs": {"Item": {"type": "object", "title": "Item", "properties": {"n": {"type": "integer"}},
                                 "required": ["n"], "additionalProperties": False}},
              "type": "object", "title": "Order", "description": "x",
              "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
              "required": ["items"], "additionalProperties": False}
    assert "items" in schema_grammar(schema).gbnf


def test_grammars_are_cached_per_schema():
    assert schema_grammar(HA_TASK).gbnf is schema_grammar(dict(HA_TASK)).gbnf


def test_tool_call_grammar_bounds_unbounded_arrays():
    g = tool_call_grammar([("f", {"type": "object", "properties": {"d": {"type": "array", "items": {"type": "string"}}},
                                  "required": ["d"]})], "generic", parallel=False)
    assert '"\\"f\\""' in g.gbnf and "{0,3}" not in g.gbnf
    assert "tool0-args-d" in g.gbnf


def test_draft_4_tuple_items_are_prefix_items():
    # {"items": [...]}: llama-server reads the list form as a tuple, exactly those items in order.
    g = schema_grammar({"items": [{"type": "integer"}, {"type": "string"}]})
    root = next(line for line in g.gbnf.splitlines() if line.startswith("root ::="))
    assert "integer" in root and "string" in root and "," in root
    assert normalise_schema({"items": [{"type": "integer"}]}) == {"prefixItems": [{"type": "integer"}]}
